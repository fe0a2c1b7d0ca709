"""The operator's dashboard at `GET /_crossbar/`: one self-contained HTML page (inline CSS and
vanilla JS, no external assets, no build step) that polls the JSON admin endpoints every two
seconds and redraws itself.

Every value from the API reaches the DOM as text (`textContent` / `append` of strings) or as an
attribute set with `setAttribute`, never as markup; the Content-Security-Policy sent with the page
forbids anything but its own inline code and same-origin fetches.
"""

from __future__ import annotations

from functools import cache

REFRESH_MS = 2000

HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

STYLE = """
:root { color-scheme: light dark; --bg: #f6f7f9; --card: #fff; --fg: #1d2330; --dim: #687082;
  --line: #e2e5ea; --ok: #1a8f4c; --bad: #c9372c; --warn: #b7791f; --bar: #3b82f6; }
@media (prefers-color-scheme: dark) { :root { --bg: #14171c; --card: #1c2027; --fg: #e4e7ec;
  --dim: #8b93a3; --line: #2c323c; --ok: #3ccf7a; --bad: #ff6b5e; --warn: #e0a43a; --bar: #5b9bff; } }
* { box-sizing: border-box; }
body { margin: 0; padding: 16px 20px 32px; background: var(--bg); color: var(--fg);
  font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
header { display: flex; align-items: baseline; gap: 16px; margin-bottom: 12px; }
h1 { font-size: 20px; margin: 0; letter-spacing: .02em; }
h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .06em; color: var(--dim);
  margin: 0 0 8px; font-weight: 600; }
#status { color: var(--dim); font-size: 12px; }
#status.err { color: var(--bad); font-weight: 600; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin-bottom: 14px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 8px 14px;
  min-width: 120px; }
.card b { display: block; font-size: 20px; font-variant-numeric: tabular-nums; }
.card span { color: var(--dim); font-size: 12px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 12px 14px;
  margin-bottom: 14px; overflow-x: auto; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 10px 4px 0; border-bottom: 1px solid var(--line);
  white-space: nowrap; vertical-align: top; }
th { color: var(--dim); font-weight: 600; font-size: 12px; }
tbody tr:last-child td { border-bottom: 0; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.wrap { white-space: normal; }
td.empty { color: var(--dim); font-style: italic; }
code { font: 12px ui-monospace, SFMono-Regular, Menlo, monospace; }
.dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin-right: 6px; }
.up { color: var(--ok); } .up .dot { background: var(--ok); }
.down { color: var(--bad); } .down .dot { background: var(--bad); }
.drain { color: var(--warn); } .drain .dot { background: var(--warn); }
tr[data-event="yield"] td:last-child { color: var(--warn); font-weight: 600; }
.tag { display: inline-block; padding: 0 6px; margin: 0 4px 2px 0; border-radius: 4px;
  border: 1px solid var(--line); font-size: 12px; }
.dim { color: var(--dim); }
.bar { display: inline-block; width: 70px; height: 7px; border-radius: 4px; background: var(--line);
  margin-right: 6px; vertical-align: middle; overflow: hidden; }
.bar i { display: block; height: 100%; background: var(--bar); }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); gap: 0 14px; }
"""

BODY = """
<header><h1>crossbar</h1><span id="status">loading…</span></header>
<div class="cards" id="cards"></div>
<section><h2>Hosts</h2><table id="hosts"><thead><tr><th>Host</th><th>Health</th><th>Loaded models</th>
<th class="num">Slots in use</th><th class="num">Free</th><th class="num">Queued</th><th>Draining</th>
<th>Last error</th></tr></thead><tbody></tbody></table></section>
<section><h2>Usage by route, last 24 h</h2><table id="usage"><thead><tr><th>Route</th>
<th class="num">Requests</th><th class="num">Errors</th><th class="num">Prompt tokens</th>
<th class="num">Cached</th><th class="num">Completion</th><th>Cache hit</th><th class="num">Busy</th>
<th class="num">Queued</th></tr></thead><tbody></tbody></table></section>
<div class="grid">
<section><h2>Leases</h2><table id="leases"><thead><tr><th>Route</th><th>Model</th><th>Host</th>
<th>Keyed by</th><th>Key</th><th>State</th><th class="num">Last used</th></tr></thead><tbody></tbody></table>
</section>
<section><h2>Recent lease moves</h2><table id="events"><thead><tr><th class="num">When</th>
<th>Route</th><th>Model</th><th>Keyed by</th><th>Key</th><th>From → to</th><th>Reason</th></tr></thead>
<tbody></tbody></table></section>
</div>
"""

SCRIPT = """
"use strict";
const BASE = "/_crossbar/";
// With admin_token set, open the page as /_crossbar/#token=<admin_token>: the fragment never
// leaves the browser; the page keeps the token for this tab and sends it as a bearer token.
const TOKEN = (() => {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("crossbar-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("crossbar-token") || "";
})();
const SOURCES = {hosts: "hosts", routes: "routes", usage: "usage?by=route&since=24h",
                 events: "events?limit=20"};

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  node.append(...kids.map(k => (k instanceof Node ? k : String(k ?? ""))));
  return node;
}
const num = v => (typeof v === "number" ? v : 0).toLocaleString("en-US");
// a session key is "s:" + a hash of the session id; a fingerprint is a bare hash; "" is the route's
const short = fp => (fp ? fp.replace(/^s:/, "").slice(0, 10) : "—");
const KEY_KINDS = {session: "the session the client named in a header",
                   fingerprint: "the conversation's first system and user message",
                   route: "one lease for the whole route"};
const keyed = (kind, fp) => el("td", {title: KEY_KINDS[kind] || ""}, kind || (fp ? "fingerprint" : "route"));
function ago(iso) {
  const t = Date.parse(iso || "");
  if (Number.isNaN(t)) return "—";
  const s = Math.max(0, (Date.now() - t) / 1000);
  if (s < 60) return Math.round(s) + "s ago";
  if (s < 3600) return Math.round(s / 60) + "m ago";
  if (s < 86400) return (s / 3600).toFixed(1) + "h ago";
  return (s / 86400).toFixed(1) + "d ago";
}
function fill(id, rows, cols, empty) {
  const body = document.querySelector("#" + id + " tbody");
  if (!rows.length) {
    body.replaceChildren(el("tr", {}, el("td", {class: "empty", colspan: cols}, empty)));
  } else {
    body.replaceChildren(...rows);
  }
}
function health(h) {
  const [cls, text] = !h.healthy ? ["down", "down"] : h.draining ? ["drain", "draining"] : ["up", "up"];
  return el("span", {class: cls}, el("span", {class: "dot"}), text);
}
function tags(list) {
  if (!list || !list.length) return el("span", {class: "dim"}, "none");
  const box = el("span", {});
  for (const m of list) box.append(el("span", {class: "tag"}, m));
  return box;
}
function hitBar(cached, prompt) {
  if (!prompt) return el("span", {class: "dim"}, "—");
  const share = Math.min(1, cached / prompt);
  const bar = el("span", {class: "bar"}, el("i", {style: "width:" + (share * 100).toFixed(1) + "%"}));
  return el("span", {}, bar, (share * 100).toFixed(1) + "%");
}

function renderHosts(hosts) {
  const rows = Object.entries(hosts).map(([name, h]) => el("tr", {"data-host": name},
    el("td", {}, el("b", {}, name)), el("td", {}, health(h)), el("td", {class: "wrap"}, tags(h.loaded)),
    el("td", {class: "num"}, num(h.in_flight)), el("td", {class: "num"}, num(h.free_slots)),
    el("td", {class: "num"}, num(h.queued)), el("td", {}, h.draining ? "yes" : "no"),
    el("td", {class: "dim wrap"}, h.last_err || "")));
  fill("hosts", rows, 8, "no hosts configured");
  return hosts;
}
function renderLeases(routes) {
  const leases = [];
  for (const [route, r] of Object.entries(routes)) {
    for (const l of r.leases || []) leases.push({route, ...l});
  }
  leases.sort((a, b) => (b.last_used || "").localeCompare(a.last_used || ""));
  const rows = leases.slice(0, 200).map(l => el("tr", {"data-route": l.route, "data-fp": l.fp},
    el("td", {}, l.route), el("td", {}, l.model || "—"), el("td", {}, l.host),
    keyed(l.key, l.fp), el("td", {}, el("code", {title: l.fp}, short(l.fp))),
    el("td", {}, l.state + (routes[l.route] && routes[l.route].pinned ? " (route pinned)" : "")),
    el("td", {class: "num", title: l.last_used}, ago(l.last_used))));
  fill("leases", rows, 7, "no live leases");
  return Object.values(routes).reduce((n, r) => n + (r.lease_count ?? (r.leases || []).length), 0);
}
function renderUsage(usage) {
  const rows = usage.map(u => el("tr", {"data-usage": u.key},
    el("td", {}, u.key || "—"), el("td", {class: "num"}, num(u.requests)),
    el("td", {class: "num"}, num(u.errors)), el("td", {class: "num"}, num(u.prompt_tokens)),
    el("td", {class: "num"}, num(u.cached_tokens)), el("td", {class: "num"}, num(u.completion_tokens)),
    el("td", {}, hitBar(u.cached_tokens, u.prompt_tokens)),
    el("td", {class: "num"}, ((u.busy_ms || 0) / 1000).toFixed(1) + " s"),
    el("td", {class: "num"}, num(u.queued_ms) + " ms")));
  fill("usage", rows, 9, "no requests in the last 24 h");
}
function renderEvents(events) {
  const rows = events.map(e => el("tr", {"data-event": e.reason},
    el("td", {class: "num", title: e.ts}, ago(e.ts)), el("td", {}, e.route), el("td", {}, e.model || "—"),
    keyed(e.key, e.fp), el("td", {}, el("code", {title: e.fp}, short(e.fp))),
    el("td", {}, (e.from || "—") + " → " + (e.to || "—")), el("td", {}, e.reason)));
  fill("events", rows, 7, "no lease moves yet");
}
function card(value, label) { return el("div", {class: "card"}, el("b", {}, value), el("span", {}, label)); }
function renderCards(d) {
  const cards = [];
  if (d.hosts) {
    const hs = Object.values(d.hosts);
    cards.push(card(hs.filter(h => h.healthy).length + " / " + hs.length, "hosts healthy"));
    cards.push(card(num(hs.reduce((n, h) => n + (h.in_flight || 0), 0)), "in flight"));
    cards.push(card(num(hs.reduce((n, h) => n + (h.queued || 0), 0)), "queued"));
  }
  if (d.leases !== undefined) cards.push(card(num(d.leases), "leases"));
  if (d.events) {
    cards.push(card(num(d.events.filter(e => e.reason === "yield").length), "yields, last moves"));
  }
  if (d.usage) {
    const sum = k => d.usage.reduce((n, u) => n + (u[k] || 0), 0);
    const prompt = sum("prompt_tokens");
    cards.push(card(num(sum("requests")), "requests, 24 h"));
    const hit = prompt ? (100 * sum("cached_tokens") / prompt).toFixed(1) + "%" : "—";
    cards.push(card(hit, "cache hit, 24 h"));
  }
  document.getElementById("cards").replaceChildren(...cards);
}

async function get(path) {
  const headers = {Accept: "application/json"};
  if (TOKEN) headers.Authorization = "Bearer " + TOKEN;
  const resp = await fetch(BASE + path, {cache: "no-store", headers});
  if (resp.status === 401) throw new Error("open this page as " + BASE + "#token=<admin_token>");
  if (!resp.ok) throw new Error(path.split("?")[0] + ": HTTP " + resp.status);
  return resp.json();
}
async function refresh() {
  const keys = Object.keys(SOURCES);
  const got = await Promise.allSettled(keys.map(k => get(SOURCES[k])));
  const d = {}, failed = [];
  got.forEach((g, i) => (g.status === "fulfilled" ? (d[keys[i]] = g.value) : failed.push(g.reason)));
  if (d.hosts) renderHosts(d.hosts);
  if (d.routes) d.leases = renderLeases(d.routes);
  if (d.usage) renderUsage(d.usage);
  if (d.events) renderEvents(d.events);
  renderCards(d);
  const status = document.getElementById("status");
  status.className = failed.length ? "err" : "";
  status.textContent = failed.length
    ? "cannot refresh: " + failed.map(e => (e && e.message) || String(e)).join("; ")
    : "updated " + new Date().toLocaleTimeString();
}
async function loop() {
  if (!document.hidden) {
    try { await refresh(); } catch (err) {
      const status = document.getElementById("status");
      status.className = "err";
      status.textContent = "cannot refresh: " + String(err);
    }
  }
  setTimeout(loop, REFRESH_MS);
}
loop();
"""


@cache
def page() -> bytes:
    script = SCRIPT.replace('"use strict";', f'"use strict";\nconst REFRESH_MS = {REFRESH_MS};', 1)
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>crossbar</title><style>{STYLE}</style></head>\n<body>{BODY}"
        f"<script>{script}</script></body></html>\n"
    ).encode()
