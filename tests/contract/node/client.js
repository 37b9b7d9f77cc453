#!/usr/bin/env node
// A slotwise client built from protos/ alone (no generated code, no Python): proves that the
// contract is usable by another gRPC stack.
//
//   node client.js --prep HOST:PORT --infer HOST:PORT --image FILE.png [--max-tokens N]
//                  [--session ID]
//
// Prepare (chat: a system message, then user text + the image + text) on the prep service, then
// Generate on the inference service with the returned PreparedPrompt and greedy sampling.
// With --session, the Generate is a turn of session ID (created first unless it exists), and
// both calls carry the metadata x-slotwise-session: ID, by which a proxy in front of several
// replicas (deploy/nginx) routes every call of one session to the replica that holds it.
// Prints one JSON summary on stdout; exits 1 with the gRPC error on stderr if a call fails.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'protos');
const MAX_MESSAGE_BYTES = 256 * 1024 * 1024; // a PreparedPrompt carries raw RGB
// keepCase: field names as written in the .proto files; oneofs: a virtual property naming the
// member that is set (chunk.kind, event.event); defaults: unset scalars read as their default.
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

function loadProtos() {
  const definition = protoLoader.loadSync(['slotwise/v1/prep.proto', 'slotwise/v1/infer.proto'], {
    ...LOADER_OPTIONS,
    includeDirs: [PROTO_ROOT],
  });
  return grpc.loadPackageDefinition(definition).slotwise.v1;
}

function parseArgs(argv) {
  const args = { maxTokens: 8, timeoutMs: 60000 };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === '--prep') args.prep = value;
    else if (flag === '--infer') args.infer = value;
    else if (flag === '--image') args.image = value;
    else if (flag === '--max-tokens') args.maxTokens = Number.parseInt(value, 10);
    else if (flag === '--timeout-ms') args.timeoutMs = Number.parseInt(value, 10);
    else if (flag === '--session') args.session = value;
    else throw new Error(`unknown flag ${flag}`);
  }
  for (const required of ['prep', 'infer', 'image']) {
    if (!args[required]) throw new Error(`--${required} is required`);
  }
  return args;
}

function deadline(ms) {
  return new Date(Date.now() + ms);
}

function prepare(stub, request, ms) {
  return new Promise((resolve, reject) => {
    stub.Prepare(request, { deadline: deadline(ms) }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

const AFFINITY_HEADER = 'x-slotwise-session';

function affinity(sessionId) {
  const metadata = new grpc.Metadata();
  if (sessionId) metadata.set(AFFINITY_HEADER, sessionId);
  return metadata;
}

function createSession(stub, sessionId, ms) {
  return new Promise((resolve, reject) => {
    stub.CreateSession({ session_id: sessionId }, affinity(sessionId), { deadline: deadline(ms) },
      (err, response) => {
        if (err && err.code !== grpc.status.ALREADY_EXISTS) reject(err);
        else resolve(response);
      });
  });
}

function generate(stub, request, ms) {
  return new Promise((resolve, reject) => {
    const events = [];
    const call = stub.Generate(request, affinity(request.session_id), { deadline: deadline(ms) });
    call.on('data', (event) => events.push(event));
    call.on('error', reject);
    call.on('end', () => resolve(events));
  });
}

function summarize(prepared, events) {
  const prompt = prepared.prompt;
  let cells = 0;
  let positions = 0;
  const media = [];
  for (const chunk of prompt.chunks) {
    if (chunk.kind === 'text') {
      cells += chunk.text.token_ids.length;
      positions += chunk.text.token_ids.length;
    } else if (chunk.kind === 'media') {
      const m = chunk.media;
      // prep sends the image as a file (m.encoded); raw RGB (m.rgb) is the other form
      if (m.pixels === 'rgb' && m.rgb.length !== m.width * m.height * 3) {
        throw new Error(`media ${m.media_id}: ${m.rgb.length} bytes for ${m.width}x${m.height}`);
      }
      if (m.pixels !== 'rgb' && !(m.encoded && m.encoded.length)) {
        throw new Error(`media ${m.media_id}: no pixels`);
      }
      cells += m.num_cells;
      positions += m.num_positions;
      media.push({
        media_id: m.media_id,
        width: m.width,
        height: m.height,
        num_cells: m.num_cells,
        num_positions: m.num_positions,
        message_index: chunk.message_index,
        media_group: chunk.media_group,
      });
    } else {
      throw new Error(`chunk with unknown kind ${chunk.kind}`);
    }
  }
  const kinds = {};
  const tokenIds = [];
  let text = '';
  let started = null;
  let finished = null;
  for (const event of events) {
    kinds[event.event] = (kinds[event.event] || 0) + 1;
    if (event.event === 'started') started = event.started;
    else if (event.event === 'delta') {
      tokenIds.push(...event.delta.token_ids);
      text += event.delta.text;
    } else if (event.event === 'finished') finished = event.finished;
  }
  if (!started || !finished) throw new Error('the stream lacks a started or finished event');
  return {
    fingerprint: prompt.fingerprint,
    num_chunks: prompt.chunks.length,
    num_text_chunks: prompt.chunks.filter((c) => c.kind === 'text').length,
    num_media_chunks: media.length,
    num_cells: prompt.num_cells,
    num_positions: prompt.num_positions,
    num_cells_counted: cells, // recomputed here from the chunks, as a client would budget
    num_positions_counted: positions,
    media,
    started: {
      num_prompt_cells: started.num_prompt_cells,
      num_prompt_positions: started.num_prompt_positions,
      num_capacity_cells: started.num_capacity_cells,
    },
    event_counts: kinds,
    num_generated_tokens: tokenIds.length,
    token_ids: tokenIds,
    text,
    finish_reason: finished.reason,
    usage: finished.usage,
  };
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const v1 = loadProtos();
  const options = {
    'grpc.max_send_message_length': MAX_MESSAGE_BYTES,
    'grpc.max_receive_message_length': MAX_MESSAGE_BYTES,
  };
  const credentials = grpc.credentials.createInsecure();
  const prep = new v1.PrepService(args.prep, credentials, options);
  const infer = new v1.InferService(args.infer, credentials, options);
  try {
    const png = fs.readFileSync(args.image);
    const prepared = await prepare(
      prep,
      {
        chat: {
          messages: [
            { role: 'system', parts: [{ text: 'You are terse.' }] },
            {
              role: 'user',
              parts: [{ text: 'What is in' }, { image: { data: png } }, { text: 'this picture?' }],
            },
          ],
        },
      },
      args.timeoutMs,
    );
    if (args.session) await createSession(infer, args.session, args.timeoutMs);
    const events = await generate(
      infer,
      {
        prompt: prepared.prompt, // passed back as received: the contract between the services
        sampling: { temperature: 0 }, // greedy (an explicitly set proto3 `optional`)
        max_tokens: args.maxTokens,
        session_id: args.session || '',
      },
      args.timeoutMs,
    );
    process.stdout.write(`${JSON.stringify(summarize(prepared, events))}\n`);
  } finally {
    prep.close();
    infer.close();
  }
}

main().catch((err) => {
  const code = err.code !== undefined ? ` (gRPC ${grpc.status[err.code] || err.code})` : '';
  process.stderr.write(`client.js: ${err.details || err.message}${code}\n`);
  process.exit(1);
});
