// The fleet page (controlplane/api/ui.py): reads and acts through the admin API's /v1 routes
// with the operator's bearer token, as meridianctl does. No framework, no build step.
//
// Every value from the API goes into the DOM as text (textContent, text nodes, attribute
// values set with setAttribute), never through a setter that parses markup, so nothing the API
// answers is ever parsed as HTML.
"use strict";

(() => {
  const POLL_MS = 1500; // how often the page asks the controller (docs/observability.md)
  const TIMEOUT_MS = 5000; // one request
  const TOKEN_KEY = "meridian-token"; // sessionStorage: this tab only, gone when it closes
  const EVENTS_KEPT = 200;
  const API = "../v1/"; // relative to /ui/: the same origin, behind any path prefix

  const $ = (id) => document.getElementById(id);

  // -- DOM: elements with text children only --------------------------------------------------

  const ATTRIBUTES = new Set([
    "class", "data-region", "data-state", "data-kind", "data-view", "data-geo", "data-name",
    "data-type", "data-change", "value", "title", "min", "max",
  ]);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (!ATTRIBUTES.has(name)) throw new Error(`attribute ${name} is not allowed`);
      node.setAttribute(name, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child)); // a string: a text node
    }
    return node;
  }

  function word(value) {
    // a CSS class from an API value: letters and dashes only
    return /^[a-z][a-z-]{0,30}$/.test(String(value)) ? String(value) : "unknown";
  }

  const pct = (w) => (typeof w === "number" ? `${Math.round(w * 1000) / 10} %` : "–");
  const num = (x) => (typeof x === "number" ? x.toFixed(1) : "–");
  const clock = (at) => (typeof at === "number" ? new Date(at * 1000).toTimeString().slice(0, 8) : "–");

  function shares(byRegion) {
    const parts = Object.entries(byRegion || {})
      .sort(([a], [b]) => a.localeCompare(b))
      .map(([region, share]) => `${region} ${pct(share)}`);
    return parts.length ? parts.join(", ") : "nobody";
  }

  // -- the admin API --------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, problem, text) {
      const detail = (problem && problem.detail) || text || `HTTP ${status}`;
      super(detail);
      this.status = status;
      this.detail = detail;
      this.fix = (problem && problem.fix) || "";
      this.title = (problem && problem.title) || "";
    }
  }

  let token = null;
  let session = 0; // bumped on every login and logout: answers to an older session are dropped

  async function api(method, path, { body, headers, auth = true } = {}) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
    try {
      const h = { Accept: "application/json", ...(headers || {}) };
      if (auth) h.Authorization = `Bearer ${token}`;
      if (body !== undefined) h["Content-Type"] = "application/json";
      const r = await fetch(API + path, {
        method,
        headers: h,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: abort.signal,
        cache: "no-store",
        credentials: "omit",
        redirect: "error",
      });
      const text = await r.text();
      let data = null;
      try {
        data = text ? JSON.parse(text) : null;
      } catch (_) {
        data = null;
      }
      if (!r.ok) throw new ApiError(r.status, data, text.slice(0, 200));
      return data;
    } finally {
      clearTimeout(timer);
    }
  }

  // -- login ----------------------------------------------------------------------------------

  function clearData() {
    for (const id of ["regions-body", "serving", "dns", "events", "result", "window",
      "dns-generation", "dns-note", "alert", "stale", "replica", "action-region",
      "action-target"]) {
      $(id).replaceChildren();
    }
    $("alert").hidden = true;
    $("stale").hidden = true;
    $("fleet").classList.remove("stale");
    state.cursor = null;
    state.events = [];
    state.regions = [];
    state.plan = null;
    $("apply").disabled = true;
  }

  function prompt(message) {
    session += 1;
    clearTimeout(state.timer);
    token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    clearData();
    $("fleet").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("token").value = "";
    $("token").focus();
  }

  function start(presented) {
    session += 1;
    token = presented;
    sessionStorage.setItem(TOKEN_KEY, presented);
    clearData();
    state.verified = false;
    $("login").hidden = true;
    $("replica").textContent = "checking the token…";
    poll(session);
  }

  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const presented = $("token").value.trim();
    if (!presented) {
      $("login-error").textContent = "paste a token first";
      return;
    }
    $("token").value = "";
    start(presented);
  });

  $("logout").addEventListener("click", () => prompt("token forgotten"));

  // -- polling --------------------------------------------------------------------------------

  const state = {
    timer: null,
    verified: false,
    cursor: null,
    events: [],
    regions: [],
    actions: [],
    plan: null, // the dry run shown: {action, region, target, reason}
    lastOk: null,
  };

  async function poll(mine) {
    try {
      const [listing, dns, health] = await Promise.all([
        api("GET", "regions"),
        api("GET", "dns"),
        api("GET", "health", { auth: false }),
      ]);
      const query = state.cursor ? `after=${encodeURIComponent(state.cursor)}` : "limit=50";
      const events = await api("GET", `events?${query}`);
      if (mine !== session) return;
      state.verified = true;
      state.lastOk = Date.now() / 1000;
      $("login").hidden = true;
      $("fleet").hidden = false;
      $("logout").hidden = false;
      $("stale").hidden = true;
      $("fleet").classList.remove("stale");
      showReplica(health);
      showRegions(listing);
      showDns(dns);
      showEvents(events);
      fillActionForm();
    } catch (e) {
      if (mine !== session) return;
      if (e instanceof ApiError && e.status === 401) {
        prompt(`the controller refused this token (401): ${e.detail}`);
        return;
      }
      const why = e instanceof ApiError ? `${e.status}: ${e.detail}` : String(e);
      if (!state.verified) {
        prompt(`could not check the token: ${why}`);
        return;
      }
      $("stale").textContent =
        `no answer from the controller since ${clock(state.lastOk)} (${why}); ` +
        `what you see is as it was then; retrying every ${POLL_MS / 1000} s`;
      $("stale").hidden = false;
      $("fleet").classList.add("stale");
    }
    if (mine === session) state.timer = setTimeout(() => poll(mine), POLL_MS);
  }

  function pollSoon() {
    clearTimeout(state.timer);
    const mine = session;
    state.timer = setTimeout(() => poll(mine), 100);
  }

  // -- what the page shows --------------------------------------------------------------------

  function showReplica(h) {
    const role = h.leading ? "leading" : `following ${h.leader || "no leader"}`;
    const etcd = h.etcd === "ok" ? "" : ", etcd UNAVAILABLE (failing static)";
    $("replica").textContent =
      `replica ${h.id}, ${role}${etcd}; updated ${clock(Date.now() / 1000)}, every ${POLL_MS / 1000} s`;
  }

  function showRegions(listing) {
    state.regions = listing.regions.map((r) => r.region);
    $("window").textContent = `window ${listing.window}`;
    const rows = listing.regions.map((r) =>
      el("tr", { "data-region": r.region, "data-state": word(r.state || "unjudged") },
        el("td", { class: "region" }, r.region),
        el("td", { class: "geo" }, r.geo || "–"),
        el("td", { class: `state state-${word(r.state || "unjudged")}` },
          r.state || "unjudged", r.manual_failover ? " (manual)" : null),
        el("td", { class: "num strikes" }, r.strikes),
        el("td", { class: "num weight" },
          el("meter", { min: 0, max: 1, value: typeof r.weight === "number" ? r.weight : 0 }),
          " ", pct(r.weight)),
        el("td", { class: "num capacity" }, num(r.capacity)),
        el("td", { class: "num floor" }, num(r.floor)),
        el("td", { class: "backup" }, r.backup || "–"),
        el("td", { class: `admin admin-${word(r.admin)}` }, r.admin),
        el("td", { class: "alive" }, r.alive ? "alive" : "gone"),
        el("td", { class: "reason" }, r.reason || "")));
    $("regions-body").replaceChildren(...rows);
    const geos = Object.keys(listing.serving || {}).sort();
    $("serving").replaceChildren(...geos.map((geo) =>
      el("li", { "data-geo": geo }, el("strong", {}, geo), `: ${shares(listing.serving[geo])}`)));
    const alerts = [];
    if (listing.alert) alerts.push(`ALERT: ${listing.alert}`);
    for (const bad of listing.bad_values || []) alerts.push(`bad value in etcd: ${bad}`);
    $("alert").textContent = alerts.join(" · ");
    $("alert").hidden = alerts.length === 0;
  }

  function showDns(body) {
    const applied = body.applied;
    if (!applied) {
      $("dns-generation").textContent = "";
      $("dns-note").textContent = body.problem ||
        "no DNS plan applied yet: dns.backend is off, or no window has run";
      $("dns").replaceChildren();
      return;
    }
    let gen = `generation ${applied.generation}, window ${applied.window}, applied ${clock(applied.applied_at)}`;
    if (applied.desired_generation > applied.generation) {
      gen += `; generation ${applied.desired_generation} not applied yet`;
    }
    $("dns-generation").textContent = gen;
    const note = [`${applied.backend} to ${applied.server}`];
    if (applied.error) note.push(`last error (${clock(applied.error_at)}): ${applied.error}`);
    $("dns-note").textContent = note.join("; ");
    $("dns-note").className = applied.error ? "error" : "muted";
    const views = Object.values(applied.views || {}).sort((a, b) => a.view.localeCompare(b.view));
    $("dns").replaceChildren(...views.map((v) =>
      el("div", { class: "view", "data-view": v.view, "data-geo": v.geo },
        el("h3", {}, `${v.geo}`, el("span", { class: "muted" }, ` view ${v.view}, zone ${v.zone}`)),
        el("p", { class: v.hold ? "alert" : "muted" }, (v.hold ? "HELD: " : "") + (v.reason || "")),
        el("table", { class: "records" },
          el("thead", {}, el("tr", {}, el("th", {}, "name"), el("th", {}, "type"),
            el("th", {}, "ttl"), el("th", {}, "answers"))),
          el("tbody", {}, ...(v.records || []).map((rec) =>
            el("tr", { "data-name": rec.name, "data-type": rec.type },
              el("td", { class: "name" }, rec.name),
              el("td", {}, rec.type),
              el("td", { class: "num" }, rec.ttl_s),
              el("td", { class: "values" }, ...rec.values.map((x) => el("div", {}, x))))))))));
  }

  function showEvents(body) {
    if (body.cursor) state.cursor = body.cursor;
    state.events = state.events.concat(body.events || []).slice(-EVENTS_KEPT);
    const items = state.events.slice().reverse().map((e) =>
      el("li", { "data-kind": word(e.kind), "data-region": e.region || "" },
        el("time", {}, clock(e.at)), " ",
        el("span", { class: `kind kind-${word(e.kind)}` }, e.kind), " ",
        el("span", { class: "region" }, e.region || "–"), " ",
        el("span", { class: "reason" }, e.reason)));
    $("events").replaceChildren(...items);
    if (!items.length) $("events").append(el("li", { class: "muted" }, "no events yet"));
  }

  // -- actions: whatever the admin API's OpenAPI document offers --------------------------------

  async function loadActions() {
    const doc = await api("GET", "openapi.json", { auth: false });
    const found = [];
    for (const [path, ops] of Object.entries(doc.paths || {})) {
      const m = /^\/v1\/regions\/\{region\}\/([a-z][a-z-]*)$/.exec(path);
      if (!m || !ops.post) continue;
      const ref = (((ops.post.requestBody || {}).content || {})["application/json"] || {}).schema;
      const name = ((ref && ref.$ref) || "").split("/").pop();
      const schema = ((doc.components || {}).schemas || {})[name] || {};
      found.push({
        name: m[1],
        summary: ops.post.summary || "",
        role: ops.post["x-role"] || "",
        target: Object.prototype.hasOwnProperty.call(schema.properties || {}, "target"),
      });
    }
    state.actions = found;
    $("action").replaceChildren(...found.map((a) => el("option", { value: a.name }, a.name)));
    describeAction();
  }

  function setOptions(select, values, first) {
    const keep = select.value;
    const options = (first ? [first] : []).concat(values.map((v) => [v, v]));
    const same = select.options.length === options.length &&
      options.every(([v], i) => select.options[i].value === v);
    if (!same) {
      select.replaceChildren(...options.map(([v, label]) => el("option", { value: v }, label)));
      if (options.some(([v]) => v === keep)) select.value = keep;
    }
  }

  function fillActionForm() {
    setOptions($("action-region"), state.regions, null);
    const region = $("action-region").value;
    setOptions($("action-target"), state.regions.filter((r) => r !== region),
      ["", "(the policy's choice)"]);
  }

  function chosen() {
    const action = state.actions.find((a) => a.name === $("action").value);
    const target = action && action.target ? $("action-target").value || null : null;
    return { action, region: $("action-region").value, target, reason: $("reason").value.trim() };
  }

  function describeAction() {
    const { action } = chosen();
    $("target-label").hidden = !(action && action.target);
    $("action-summary").textContent = action
      ? `${action.name}: ${action.summary} (role ${action.role}); a dry run first, then apply`
      : "";
  }

  function invalidate() {
    state.plan = null;
    $("apply").disabled = true;
  }

  for (const id of ["action", "action-region", "action-target", "reason"]) {
    $(id).addEventListener("input", invalidate);
    $(id).addEventListener("change", () => {
      invalidate();
      if (id === "action") describeAction();
      if (id === "action-region") fillActionForm();
    });
  }

  function idempotencyKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  async function act(dryRun) {
    const c = chosen();
    const out = $("result");
    if (!c.action || !c.region) {
      out.replaceChildren(el("p", { class: "error" }, "pick an action and a region"));
      return;
    }
    if (!c.reason) {
      out.replaceChildren(el("p", { class: "error" },
        "a reason is required: it goes to the audit log with your token's name"));
      $("reason").focus();
      return;
    }
    const body = { reason: c.reason };
    if (c.action.target) body.target = c.target;
    const path = `regions/${encodeURIComponent(c.region)}/${encodeURIComponent(c.action.name)}` +
      (dryRun ? "?dry_run=true" : "");
    const mine = session;
    $("dry-run").disabled = true;
    $("apply").disabled = true;
    out.replaceChildren(el("p", { class: "muted" }, dryRun ? "asking for the plan…" : "applying…"));
    try {
      const result = await api("POST", path, { body, headers: dryRun ? {} : { "Idempotency-Key": idempotencyKey() } });
      if (mine !== session) return;
      out.replaceChildren(plan(result));
      if (dryRun) {
        state.plan = c;
        $("apply").disabled = false;
      } else {
        state.plan = null;
        pollSoon();
      }
    } catch (e) {
      if (mine !== session) return;
      if (e instanceof ApiError && e.status === 401) {
        prompt(`the controller refused this token (401): ${e.detail}`);
        return;
      }
      state.plan = null;
      const head = e instanceof ApiError ? `${e.title || "refused"} (${e.status}): ${e.detail}` : String(e);
      out.replaceChildren(el("div", { class: "problem" },
        el("p", { class: "error" }, head),
        e instanceof ApiError && e.fix ? el("p", {}, `what to do: ${e.fix}`) : null));
    } finally {
      $("dry-run").disabled = false;
    }
  }

  function plan(r) {
    const changes = r.changes || [];
    const verb = r.dry_run ? "would change" : "did change";
    const geos = Array.from(new Set(Object.keys(r.serving_before || {})
      .concat(Object.keys(r.serving_after || {})))).sort();
    return el("div", { class: r.dry_run ? "plan dry-run" : "plan applied" },
      el("h3", {}, `${r.action} ${r.region || ""}: ${changes.length ? verb : `${verb} nothing`}`),
      el("ul", { class: "changes" }, ...changes.map((c) =>
        el("li", { "data-change": c.region },
          `${c.region}: ${c.state_before || "–"} → ${c.state_after}, ` +
          `weight ${pct(c.weight_before)} → ${pct(c.weight_after)}, ` +
          `backup ${c.backup_after || "none"}, floor ${num(c.floor_after)}`))),
      el("ul", { class: "shares" }, ...geos.map((g) => {
        const before = shares((r.serving_before || {})[g]);
        const after = shares((r.serving_after || {})[g]);
        return el("li", { "data-geo": g }, `geography ${g}: ${before}` +
          (before === after ? " (unchanged)" : ` → ${after}`));
      })),
      (r.events || []).length
        ? el("ul", { class: "plan-events" }, ...r.events.map((e) => el("li", {}, e)))
        : null,
      r.alert ? el("p", { class: "alert" }, `ALERT: ${r.alert}`) : null,
      el("p", { class: "audit" }, `audit ${r.audit_id} by ${r.by}: ${r.reason}` +
        (r.dry_run ? " (dry run: nothing changed)" : " (applied)")));
  }

  $("action-form").addEventListener("submit", (e) => {
    e.preventDefault();
    act(true);
  });

  $("apply").addEventListener("click", () => {
    const c = chosen();
    const p = state.plan;
    if (!p || !c.action || p.action !== c.action || p.region !== c.region ||
        p.target !== c.target || p.reason !== c.reason) {
      invalidate();
      return;
    }
    act(false);
  });

  // -- start ----------------------------------------------------------------------------------

  loadActions().catch((e) => {
    $("action-summary").textContent = `the actions could not be loaded: ${e}`;
  });
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved) start(saved);
  else prompt("");
})();
