// Calls to Shoal's HTTP API from the page. Every call goes through fetch() so that it can send
// `Authorization: Bearer <key>` when the user gave a key (EventSource cannot send headers).

const KEY_STORAGE = "shoal.apiKey";

export function apiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return ""; // storage disabled (private mode, file://): no key
  }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    // nothing to do: the key then lasts until the page is reloaded
  }
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// Who wants to hear about 401s (the page shows a banner next to the key field).
const authListeners = new Set();
export function onAuthProblem(listener) {
  authListeners.add(listener);
}

function headers(json) {
  const h = {};
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

// Relative URLs ("v1/state"), so that the page also works behind a proxy under a prefix.
function url(path) {
  return new URL(path, document.baseURI).toString();
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) {
      message = body.error.message;
      code = body.error.code;
    }
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) for (const l of authListeners) l(message);
  return new ApiError(response.status, message, code);
}

// fetch() a JSON endpoint; throws ApiError with the API's own message.
export async function api(path, { method = "GET", body, signal } = {}) {
  const response = await fetch(url(path), {
    method,
    headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// fetch() an endpoint that answers with server-sent events; returns the checked Response.
export async function openStream(path, { method = "GET", body, signal } = {}) {
  const response = await fetch(url(path), {
    method,
    headers: { ...headers(body !== undefined), Accept: "text/event-stream" },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

// The events of a server-sent event stream, as {event, data, id}, as they arrive.
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { event: "message", data: [], id: null };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop(); // an incomplete last line waits for the rest
      for (const line of lines) {
        if (line === "") {
          if (event.data.length) yield { event: event.event, data: event.data.join("\n"), id: event.id };
          event = { event: "message", data: [], id: null };
          continue;
        }
        if (line.startsWith(":")) continue; // a comment (keep-alive)
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value_ = colon < 0 ? "" : line.slice(colon + 1);
        if (value_.startsWith(" ")) value_ = value_.slice(1);
        if (field === "data") event.data.push(value_);
        else if (field === "event") event.event = value_;
        else if (field === "id") event.id = value_;
      }
    }
  } finally {
    reader.releaseLock();
  }
}
