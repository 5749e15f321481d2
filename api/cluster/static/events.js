// The live event feed: GET /v1/events (server-sent events tailing the log), read with fetch()
// so that it can send the API key; reconnects by itself.

import { openStream, sseEvents } from "./api.js";
import { $, clock, h, parseTime, stateKind } from "./dom.js";

const MAX_ROWS = 300;
// Fields worth a glance in a one-line summary, in this order.
const ID_FIELDS = ["node_id", "instance_id", "runner_id", "task_id", "model_id"];
const DETAIL_FIELDS = ["state", "status", "reason", "error", "finish_reason"];
const HEARTBEAT = "ResourceProfiled";

export class EventFeed {
  constructor({ onEvent, onStatus }) {
    this.onEvent = onEvent;
    this.onStatus = onStatus;
    this.list = $("events");
    this.paused = false;
    this.controller = null;
    this.lastId = null;
    $("events-heartbeats").addEventListener("change", () => this.applyFilter());
    $("events-pause").addEventListener("click", (ev) => {
      this.paused = !this.paused;
      ev.currentTarget.textContent = this.paused ? "Resume" : "Pause";
    });
    $("events-clear").addEventListener("click", () => this.list.replaceChildren());
  }

  // (Re)connect, e.g. after the API key changed.
  restart() {
    if (this.controller) this.controller.abort();
    this.controller = new AbortController();
    this.run(this.controller.signal);
  }

  async run(signal) {
    let delay = 500;
    while (!signal.aborted) {
      try {
        // The first time, the recent past too; after a drop, only what is new (the rows
        // shown already stay).
        // Heartbeats are most of the log: 1000 events are minutes of the rest.
        const last = this.lastId === null ? 1000 : 0;
        const response = await openStream(`v1/events?last=${last}`, { signal });
        this.onStatus("live");
        delay = 500;
        for await (const ev of sseEvents(response)) this.add(ev);
        this.onStatus("reconnecting");
      } catch (err) {
        if (signal.aborted) return;
        this.onStatus(err.status === 401 ? "needs key" : "reconnecting");
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 10000);
    }
  }

  add(ev) {
    let data = null;
    try {
      data = JSON.parse(ev.data);
    } catch {
      data = { raw: ev.data };
    }
    this.lastId = ev.id;
    this.onEvent(ev.event, data);
    // Heartbeats come every few seconds from every node: shown only when asked for, so that
    // they do not push the rest out.
    if (this.paused || (ev.event === HEARTBEAT && !$("events-heartbeats").checked)) return;
    const row = this.row(ev, data);
    this.list.prepend(row);
    while (this.list.childElementCount > MAX_ROWS) this.list.lastElementChild.remove();
  }

  row(ev, data) {
    const ids = ID_FIELDS.filter((f) => data[f]).map((f) => h("span", { class: "mono" }, String(data[f])));
    const details = DETAIL_FIELDS.filter((f) => data[f] !== undefined && data[f] !== null).map((f) => String(data[f]));
    const kind = data.state ? stateKind(data.state) : /Failed|Rejected|TimedOut/.test(ev.event) ? "bad" : "";
    const summary = h(
      "summary",
      {},
      h("time", { class: "ev-time" }, clock(parseTime(data.ts))),
      h("span", { class: `ev-type ${kind}` }, ev.event),
      h("span", { class: "ev-ids" }, ids),
      details.length ? h("span", { class: "ev-detail" }, details.join(" · ")) : null,
    );
    const row = h(
      "details",
      { class: "ev", dataset: { type: ev.event, seq: ev.id || "" } },
      summary,
      h("pre", { class: "ev-json" }, JSON.stringify(data, null, 2)),
    );
    return row;
  }

  applyFilter() {
    if ($("events-heartbeats").checked) return; // shown from now on
    for (const row of [...this.list.children]) if (row.dataset.type === HEARTBEAT) row.remove();
  }
}
