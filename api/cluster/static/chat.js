// The chat box: POST /v1/chat/completions with stream: true, read with fetch() and a stream
// reader, the text shown as it arrives. The conversation is kept in the page only.

import { openStream, sseEvents } from "./api.js";
import { $, h } from "./dom.js";

export function setupChat() {
  const form = $("chat-form");
  const input = $("chat-input");
  const send = $("chat-send");
  const log = $("chat-log");
  const history = [];
  let running = null; // the AbortController of the reply being streamed

  $("chat-clear").addEventListener("click", () => {
    if (running) running.abort();
    history.length = 0;
    log.replaceChildren();
  });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    if (running) {
      running.abort(); // the API then cancels the task: the runner stops within a token
      return;
    }
    const text = input.value.trim();
    const model = $("chat-model").value;
    if (!text) return;
    if (!model) {
      bubble(log, "error", "No model to talk to: request an instance first.");
      return;
    }
    input.value = "";
    history.push({ role: "user", content: text });
    bubble(log, "user", text);
    running = new AbortController();
    send.textContent = "Stop";
    send.classList.add("danger");
    try {
      const reply = await stream(log, model, history, running.signal);
      if (reply !== null) history.push({ role: "assistant", content: reply });
      else history.pop();
    } finally {
      running = null;
      send.textContent = "Send";
      send.classList.remove("danger");
      input.focus();
    }
  });
}

function bubble(log, role, text) {
  const body = h("div", { class: "msg-text" }, text);
  const el = h("div", { class: `msg ${role}` }, h("div", { class: "msg-role" }, role), body);
  log.append(el);
  log.scrollTop = log.scrollHeight;
  return { el, body };
}

// Streams one reply into a new bubble; returns its text, or null when it failed.
async function stream(log, model, history, signal) {
  const { el, body } = bubble(log, "assistant", "");
  el.classList.add("streaming");
  const request = { model, messages: history, stream: true, stream_options: { include_usage: true } };
  const temperature = Number($("chat-temp").value);
  if ($("chat-temp").value !== "" && Number.isFinite(temperature)) request.temperature = temperature;
  const maxTokens = Number($("chat-max").value);
  if (maxTokens > 0) request.max_tokens = maxTokens;
  const started = performance.now();
  let firstAt = null;
  let text = "";
  let usage = null;
  let finish = null;
  try {
    const response = await openStream("v1/chat/completions", { method: "POST", body: request, signal });
    for await (const ev of sseEvents(response)) {
      if (ev.data === "[DONE]") break;
      const chunk = JSON.parse(ev.data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const piece = (choice.delta && choice.delta.content) || "";
      if (piece) {
        firstAt = firstAt ?? performance.now();
        text += piece;
        body.textContent = text;
        log.scrollTop = log.scrollHeight;
      }
      finish = choice.finish_reason || finish;
    }
  } catch (err) {
    el.classList.remove("streaming");
    if (signal.aborted) {
      el.append(h("div", { class: "msg-meta" }, "stopped"));
      return text || null;
    }
    el.classList.add("error");
    el.append(h("div", { class: "error-text" }, err.message));
    return null;
  }
  el.classList.remove("streaming");
  const seconds = (performance.now() - started) / 1000;
  const facts = [];
  if (usage) facts.push(`${usage.completion_tokens} tokens`);
  facts.push(`${seconds.toFixed(1)} s`);
  if (firstAt !== null) facts.push(`first token ${Math.round(firstAt - started)} ms`);
  if (finish === "length") facts.push("cut at max tokens");
  el.append(h("div", { class: "msg-meta" }, facts.join(" · ")));
  return text;
}
