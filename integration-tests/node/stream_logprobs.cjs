// The official openai Node SDK against a running quiver stack, as integration-tests/test_client_node.py
// runs it: `node stream_logprobs.cjs BASE_URL MODEL`, with NODE_PATH at the node_modules that
// `make node-clients` installed. It streams a chat completion through the SDK's streaming helper
// and a completion with `stream: true`, both with logprobs, and prints one JSON document with every
// chunk as the SDK handed it over and the helper's final completion, for the test to check.
"use strict";

const OpenAI = require("openai");

const MAX_TOKENS = 6;

async function chatThroughHelper(client, model) {
  const stream = client.chat.completions.stream({
    model,
    messages: [{ role: "user", content: "Write about the moon." }],
    max_tokens: MAX_TOKENS,
    temperature: 0,
    logprobs: true,
    top_logprobs: 2,
    stream_options: { include_usage: true },
    // quiver's extension: every token is text, so the tokens spell the whole content.
    ignore_eos: true,
  });
  const chunks = [];
  for await (const chunk of stream) {
    // A copy: the helper appends later chunks' logprobs to the arrays of the first chunk it
    // accumulated from, so the chunk objects it handed over change afterwards.
    chunks.push(structuredClone(chunk));
  }
  return { chunks, final: await stream.finalChatCompletion() };
}

async function completionStream(client, model) {
  const stream = await client.completions.create({
    model,
    prompt: "The moon is",
    max_tokens: MAX_TOKENS,
    temperature: 0,
    logprobs: 2,
    stream: true,
    ignore_eos: true,
  });
  const chunks = [];
  for await (const chunk of stream) {
    chunks.push(chunk);
  }
  return { chunks };
}

async function main() {
  const [baseURL, model] = process.argv.slice(2);
  if (!baseURL || !model) {
    throw new Error("usage: node stream_logprobs.cjs BASE_URL MODEL");
  }
  const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120000 });
  const chat = await chatThroughHelper(client, model);
  const completion = await completionStream(client, model);
  process.stdout.write(JSON.stringify({ maxTokens: MAX_TOKENS, chat, completion }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
