// One streamed chat with an image through slotwise's OpenAI-compatible API, with the official
// `openai` npm package: prints what came back as JSON.
//   node openai_chat.js --base-url http://127.0.0.1:8080/v1 --image picture.png
"use strict";

const fs = require("node:fs");
const OpenAI = require("openai");

function arg(name) {
  const i = process.argv.indexOf(name);
  if (i < 0 || i + 1 >= process.argv.length) throw new Error(`missing ${name}`);
  return process.argv[i + 1];
}

async function main() {
  const client = new OpenAI({ baseURL: arg("--base-url"), apiKey: "unused", maxRetries: 0 });
  const url = "data:image/png;base64," + fs.readFileSync(arg("--image")).toString("base64");
  const stream = await client.chat.completions.create({
    model: "slotwise",
    max_tokens: 6,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
    messages: [
      { role: "system", content: "You are terse." },
      {
        role: "user",
        content: [
          { type: "text", text: "What is in this picture?" },
          { type: "image_url", image_url: { url } },
        ],
      },
    ],
  });
  const summary = { chunks: 0, first_role: null, text: "", finish_reason: null, usage: null };
  for await (const chunk of stream) {
    summary.chunks += 1;
    if (chunk.usage) summary.usage = chunk.usage;
    const choice = chunk.choices[0];
    if (!choice) continue;
    if (summary.chunks === 1) summary.first_role = choice.delta.role ?? null;
    summary.text += choice.delta.content ?? "";
    if (choice.finish_reason) summary.finish_reason = choice.finish_reason;
  }
  process.stdout.write(JSON.stringify(summary) + "\n");
}

main().catch((e) => {
  process.stderr.write(`${e.status ?? ""} ${e.message}\n`);
  process.exit(1);
});
