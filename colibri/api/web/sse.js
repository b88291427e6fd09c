// A chat completion's server-sent events (OpenAI's chat.completion.chunk stream, with colibri's
// own `colibri` field) read into what the console shows. No DOM: text in, plain objects out.

/** Complete server-sent events of ``buffer``: their data, and the incomplete rest. */
export function splitEvents(buffer) {
  const events = [];
  const re = /\r?\n\r?\n/g;
  let start = 0;
  for (let m; (m = re.exec(buffer)); start = re.lastIndex) {
    const data = buffer
      .slice(start, m.index)
      .split(/\r?\n/)
      .filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5))
      .join("\n");
    if (data) events.push(data);
  }
  return { events, rest: buffer.slice(start) };
}

/** The data of each event of a byte stream, as the events complete. */
export async function* eventData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const { events, rest } = splitEvents(buffer + value);
    buffer = rest;
    yield* events;
  }
}

/** One event's data as ``{error}`` or ``{piece, reasoning, finish, colibri, usage}``: ``reasoning``
 *  is a thinking model's ``reasoning_content`` (colibri, llama.cpp and vLLM send it beside
 *  ``content``); null for the closing [DONE] and for anything that is not JSON. */
export function readChunk(data) {
  if (data === "[DONE]") return null; // the stream ends right after it
  let chunk;
  try {
    chunk = JSON.parse(data);
  } catch {
    return null;
  }
  if (chunk?.error) return { error: chunk.error.message || "the generation failed" };
  const choice = chunk?.choices?.[0];
  return {
    piece: choice?.delta?.content || "",
    reasoning: choice?.delta?.reasoning_content || "",
    finish: choice?.finish_reason || null,
    colibri: chunk?.colibri || null,
    usage: chunk?.usage || null,
  };
}

/** The chunks of a chat completion's stream, read. */
export async function* chatChunks(body) {
  for await (const data of eventData(body)) {
    const chunk = readChunk(data);
    if (chunk) yield chunk;
  }
}
