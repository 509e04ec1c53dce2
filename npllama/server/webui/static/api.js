// The server's OpenAI routes, as any client uses them: /v1/models and a streamed
// /v1/chat/completions read as Server-Sent Events.

export class APIError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;  // the HTTP status (0: the server could not be reached)
    this.code = code;      // OpenAI's error code, e.g. "context_length_exceeded"
  }
}

function headers(key) {
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function request(path, init) {
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new APIError("the server could not be reached", 0, "network");
  }
  if (!response.ok) {
    let error = {};
    try { error = (await response.json()).error || {}; } catch { /* not JSON: the status says enough */ }
    throw new APIError(error.message || response.statusText, response.status, error.code);
  }
  return response;
}

/** The served model: {id, ctx} (ctx: tokens per sequence, from max_model_len). */
export async function fetchModel(key) {
  const body = await (await request("/v1/models", { headers: headers(key) })).json();
  const m = body.data[0];
  return { id: m.id, ctx: m.max_model_len ?? null };
}

/** Post a streamed chat request; yields {content}, {toolCalls} (a delta's `tool_calls`: pieces of
 * calls, each with its `index`), {finish} and {usage} events in order. */
export async function* streamChat(body, { key, signal }) {
  const response = await request("/v1/chat/completions",
    { method: "POST", headers: headers(key), body: JSON.stringify(body), signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new APIError(chunk.error.message, response.status, chunk.error.code);
        const choice = chunk.choices && chunk.choices[0];
        if (choice && choice.delta && choice.delta.content) yield { content: choice.delta.content };
        if (choice && choice.delta && choice.delta.tool_calls) yield { toolCalls: choice.delta.tool_calls };
        if (choice && choice.finish_reason) yield { finish: choice.finish_reason };
        if (chunk.usage) yield { usage: chunk.usage };
      }
    }
  }
  throw new APIError("the answer ended before it was complete", response.status, "incomplete");
}

/** A sentence for the person at the page, for an error a request met. */
export function explain(error, ctx) {
  if (!(error instanceof APIError)) return `Something went wrong: ${error.message}`;
  switch (error.status) {
    case 0: return "The server could not be reached. Is `npllama serve` still running?";
    case 401: return "The server refused the API key. Enter it again.";
    case 413: return "The request is larger than the server accepts (--max-body).";
    case 503: return `The server is busy: its queue is full. Try again in a moment. (${error.message})`;
  }
  if (error.code === "context_length_exceeded") {
    const size = ctx ? ` of ${ctx} tokens` : "";
    return `This conversation is too long for the model's context${size}: start a new chat, shorten the ` +
      `message or lower Max tokens. (${error.message})`;
  }
  return `The server answered ${error.status}: ${error.message}`;
}
