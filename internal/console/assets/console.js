// The outbox console: reads /api/state every two seconds and draws it; a
// requeue asks who and why, then posts it. Every value is put in the page
// as text (textContent), never as HTML: a dead letter's reason is data.
"use strict";

const REFRESH_MS = 2000;

// The token comes once in the address (/#token=...), and stays in this tab.
(function takeToken() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem("outbox-console-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
})();

function headers(extra) {
  const h = Object.assign({}, extra);
  const token = sessionStorage.getItem("outbox-console-token");
  if (token) h["Authorization"] = "Bearer " + token;
  return h;
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, attrs) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    if (c instanceof Node) {
      const td = document.createElement("td");
      td.appendChild(c);
      tr.appendChild(td);
    } else {
      tr.appendChild(el("td", c));
    }
  }
  for (const [k, v] of Object.entries(attrs || {})) tr.setAttribute(k, v);
  return tr;
}

function fill(tableId, rows) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren(...rows);
  document.getElementById(tableId).hidden = rows.length === 0 && tableId === "slots";
}

function figures(id, pairs) {
  const dl = document.getElementById(id);
  dl.replaceChildren(...pairs.map(([k, v]) => {
    const d = document.createElement("div");
    d.setAttribute("data-figure", k);
    d.append(el("dt", k), el("dd", v));
    return d;
  }));
}

function seconds(s) {
  return (Math.round(s * 10) / 10).toFixed(1) + "s";
}

function draw(state) {
  const st = state.status;
  const verdict = document.getElementById("verdict");
  verdict.textContent = st.healthy ? "delivering" : "NOT DELIVERED";
  verdict.className = "verdict " + (st.healthy ? "ok" : "bad");
  document.getElementById("read-at").textContent = "read " + new Date(state.read_at).toLocaleTimeString();
  document.getElementById("problems").replaceChildren(...st.problems.map((p) => el("li", p)),
    ...(state.errors || []).map((e) => el("li", e)));

  figures("backlog", [
    ["pending", st.pending], ["publishing", st.publishing], ["retrying", st.retrying], ["dead", st.dead],
    ["published", st.published_counted ? st.published : "not counted (outbox status counts it)"],
    ["oldest pending", seconds(st.oldest_pending_seconds)],
    ["live relays", st.live_relays],
  ]);
  fill("relays", st.relays.map((r) => row(
    [r.name, r.alive ? "alive" : "dead", r.ownership || "-", r.slots, r.claimed, seconds(r.lease_seconds_left)],
    { "data-name": r.name, class: r.alive ? "" : "dead" })));
  fill("slots", st.relay_partitions.filter((s) => s.waiting > 0).map((s) => row(
    [s.slot, s.owner ? s.owner + (s.alive ? "" : " (dead)") : "(none)", s.waiting, seconds(s.oldest_seconds)])));
  const capped = document.getElementById("slots-capped");
  capped.hidden = !st.relay_partitions_capped_at;
  capped.textContent = st.relay_partitions_capped_at
    ? "waiting: among the oldest " + st.relay_partitions_capped_at + " unpublished rows only, and there may be more (outbox status counts them all)"
    : "";

  document.getElementById("group-name").textContent = st.group + " on " + st.stream;
  figures("group", [
    ["stream length", st.stream_length], ["pending", st.group_pending], ["lag", st.group_lag],
    ["live members", st.live_members],
    ["members", st.members.map((m) => m.name + (m.alive ? "" : " (dead)")).join(", ") || "-"],
    ["dead letters", st.dead_lettered],
  ]);
  fill("partitions", st.by_partition.map((p) => row(
    [p.partition, p.stream, p.stream_length, p.group_pending, p.group_lag,
      p.owner ? p.owner + (p.owner_alive ? "" : " (dead)") : "(none)", p.dead_lettered],
    { "data-partition": p.partition })));

  fill("retrying", st.retrying_events.map((e) => row(
    [e.event_id, e.aggregate_type + "/" + e.aggregate_id, e.event_type, e.attempts,
      e.status === "publishing" ? "being published" : (e.next_attempt_in_seconds <= 0 ? "due now" : "in " + seconds(e.next_attempt_in_seconds)),
      reason(e.last_error)])));
  fill("dead", st.dead_events.map((e) => row(
    [e.event_id, e.aggregate_type + "/" + e.aggregate_id, e.event_type, e.attempts, reason(e.last_error),
      requeueButton("dead event " + e.event_id, "/api/dead/retry", { event_id: e.event_id })],
    { "data-event-id": e.event_id })));
  fill("dead-letters", state.dead_letters.map((d) => row(
    [d.id, d.event_id || "-", d.event_type || "-", d.dlq_deliveries, reason(d.dlq_reason),
      requeueButton("dead letter " + d.id + " (back to " + (d.dlq_stream || st.stream) + ")", "/api/dlq/retry", { id: d.id })],
    { "data-id": d.id })));
  fill("actions", state.actions.map((a) => row(
    [new Date(a.at).toLocaleString(), a.actor, a.action, a.target, a.reason, a.outcome], { "data-action-id": a.id })));
}

function reason(text) {
  return el("span", text || "-", "reason");
}

function requeueButton(what, path, body) {
  const b = el("button", "Requeue");
  b.type = "button";
  b.className = "requeue";
  b.addEventListener("click", () => confirmRequeue(what, path, body));
  return b;
}

let pending = null; // the requeue waiting for its confirmation

function confirmRequeue(what, path, body) {
  pending = { path, body };
  document.getElementById("confirm-what").textContent = "Requeue " + what + "?";
  document.getElementById("confirm-reason").value = "";
  document.getElementById("confirm").showModal();
}

async function post(path, body) {
  const res = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", "X-Outbox-Console": "1" }),
    body: JSON.stringify(body),
  });
  const out = await res.json().catch(() => ({ error: res.statusText }));
  if (!res.ok) throw new Error(out.error || res.statusText);
  return out;
}

function say(text) {
  const m = document.getElementById("message");
  m.textContent = text;
  m.hidden = false;
  clearTimeout(say.timer);
  say.timer = setTimeout(() => { m.hidden = true; }, 8000);
}

async function refresh() {
  const err = document.getElementById("error");
  try {
    const res = await fetch("/api/state", { headers: headers(), cache: "no-store" });
    const out = await res.json();
    if (!res.ok) throw new Error(out.error || res.statusText);
    draw(out);
    err.hidden = true;
  } catch (e) {
    err.textContent = "The console cannot read the state: " + e.message;
    err.hidden = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-cancel").addEventListener("click", () => { pending = null; dialog.close(); });
  document.getElementById("confirm-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const actor = document.getElementById("confirm-actor").value.trim();
    const why = document.getElementById("confirm-reason").value.trim();
    if (!pending || !actor || !why) return;
    const { path, body } = pending;
    pending = null;
    dialog.close();
    try {
      const out = await post(path, Object.assign({ actor, reason: why }, body));
      say(out.outcome + (out.audit_error ? " (audit NOT written: " + out.audit_error + ")" : " (audited as #" + out.action.id + ")"));
    } catch (e) {
      say("Not done: " + e.message);
    }
    refresh();
  });
  // One read at a time: the next starts REFRESH_MS after the last ended.
  (async function loop() {
    await refresh();
    setTimeout(loop, REFRESH_MS);
  })();
});
