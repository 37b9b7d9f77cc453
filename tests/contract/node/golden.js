#!/usr/bin/env node
// Reads every golden fixture (../golden/*.binpb) with protobufjs from protos/ and writes it back.
//
//   node golden.js
//
// Prints one JSON object on stdout: for each fixture, whether protobufjs re-encodes the exact
// bytes, whether its JSON form (protobufjs toJSON, field names in lowerCamelCase) equals the
// fixture's canonical proto3 JSON (written by Python's json_format), and a few decoded values.
'use strict';

const assert = require('node:assert');
const fs = require('node:fs');
const path = require('node:path');
const protobuf = require('protobufjs');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'protos');
const GOLDEN = path.resolve(__dirname, '..', 'golden');

function loadRoot(keepCase) {
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) => path.join(PROTO_ROOT, target);
  root.loadSync(['slotwise/v1/prompt.proto', 'slotwise/v1/infer.proto'], { keepCase });
  root.resolveAll();
  return root;
}

function typeOf(root, name) {
  return root.lookupType(name.startsWith('prepared_prompt') ? 'slotwise.v1.PreparedPrompt' : 'slotwise.v1.GenerateResponse');
}

function jsonDifference(actual, expected) {
  try {
    assert.deepStrictEqual(actual, expected);
    return null;
  } catch (err) {
    return err.message;
  }
}

function describe(name, message) {
  if (name.startsWith('prepared_prompt')) {
    return {
      num_chunks: message.chunks.length,
      num_cells: message.num_cells,
      num_positions: message.num_positions,
      kinds: message.chunks.map((c) => c.kind),
    };
  }
  return { kind: message.event };
}

function main() {
  const root = loadRoot(true); // field names as in the .proto files
  const jsonRoot = loadRoot(false); // lowerCamelCase, the proto3 JSON names
  const out = {};
  for (const file of fs.readdirSync(GOLDEN).sort()) {
    if (!file.endsWith('.binpb')) continue;
    const name = file.slice(0, -'.binpb'.length);
    const type = typeOf(root, name);
    const bytes = fs.readFileSync(path.join(GOLDEN, file));
    const message = type.decode(bytes);
    const again = Buffer.from(type.encode(message).finish());
    const golden = JSON.parse(fs.readFileSync(path.join(GOLDEN, `${name}.json`), 'utf8'));
    const asJson = typeOf(jsonRoot, name).decode(bytes).toJSON();
    out[name] = {
      same_bytes: again.equals(bytes),
      verify_error: type.verify(message),
      json_difference: jsonDifference(asJson, golden),
      ...describe(name, message),
    };
  }
  process.stdout.write(`${JSON.stringify(out)}\n`);
}

main();
