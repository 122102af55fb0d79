// memprune review page: everything it shows comes from the embedded JSON document (and, for a big store, the
// data files beside it); every text from the store is put on the page with textContent, never parsed as HTML.
"use strict";
(function () {
  const doc = JSON.parse(document.getElementById("memprune-data").textContent);
  const parts = window.__memprune_parts || [];
  const F = doc.fields;
  const R = {};  // record columns, every piece joined
  F.forEach((f) => { R[f] = []; });
  const pieces = doc.records ? [doc.records] : parts;
  pieces.forEach((p) => F.forEach((f) => { for (const v of p[f]) R[f].push(v); }));
  const N = R.id.length;
  const byId = new Map();
  for (let i = 0; i < N; i++) byId.set(R.id[i], i);
  const replaces = new Map();  // index -> indices of the records it replaced (duplicates, superseded)
  for (let i = 0; i < N; i++) {
    for (const t of [R.duplicate_of[i], R.superseded_by[i]]) {
      if (t == null || !byId.has(t)) continue;
      const j = byId.get(t);
      if (!replaces.has(j)) replaces.set(j, []);
      replaces.get(j).push(i);
    }
  }
  const meta = doc.meta;
  const now = meta.now_epoch;
  const $ = (id) => document.getElementById(id);
  const el = (tag, props, ...kids) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (k === "text") e.textContent = v;
      else if (k === "cls") e.className = v;
      else if (k.startsWith("data-") || k === "title" || k === "href" || k === "type" || k === "value") e.setAttribute(k, v);
      else e[k] = v;
    }
    for (const kid of kids) if (kid != null) e.append(kid);
    return e;
  };
  const fmt = (x, d = 3) => (x == null ? "–" : Number(x).toFixed(d));
  const int = (x) => (x == null ? "–" : Number(x).toLocaleString("en-US"));
  const day = (t) => (t == null ? "–" : new Date(t * 1000).toISOString().slice(0, 10));
  const age = (i) => (R.time[i] == null || now == null ? null : now - R.time[i]);

  // ---------------------------------------------------------------- summary
  function summary() {
    const c = doc.counts;
    $("title").textContent = meta.title;
    $("subtitle").textContent = meta.subtitle;
    const cards = [["records", c.records], ["kept", c.kept], ["dropped", c.dropped], ["groups", c.groups]];
    if (doc.present.pinned) cards.push(["pinned", c.pinned]);
    if (c.tokens != null) cards.push(["tokens", `${int(c.tokens)} → ${int(c.tokens_kept)}`]);
    $("cards").replaceChildren(...cards.map(([k, v]) => el("div", { cls: "card", "data-count": k },
      el("div", { cls: "n", text: typeof v === "number" ? int(v) : v }), el("div", { cls: "k", text: k }))));
    const reasons = Object.entries(c.by_reason).sort((a, b) => b[1] - a[1]);
    $("reasons").replaceChildren(...reasons.map(([r, n]) => el("li", { "data-reason": r },
      el("a", { href: "#records", text: r, onclick: (e) => { e.preventDefault(); setFilter({ reason: r }); } }),
      el("span", { cls: "n", text: ` ${int(n)}` }))));
    $("rule").textContent = meta.rule;
    $("facts").replaceChildren(...meta.facts.map(([k, v]) => el("tr", {}, el("th", { text: k }), el("td", { text: v }))));
    if (meta.apply) {
      $("apply").hidden = false;
      $("apply-text").textContent = meta.apply.text;
      $("restore-cmd").textContent = meta.apply.restore;
    }
    $("selection-cmd").textContent = meta.restore_ids;
  }

  // ---------------------------------------------------------------- the score distribution
  function histogram() {
    const h = doc.histogram;
    const W = 640, H = 180, pad = 44, right = 12, bins = h.kept.length;
    const top = Math.max(1, ...h.kept.map((k, i) => k + h.dropped[i]));
    const svgNS = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(svgNS, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H + pad}`);
    svg.setAttribute("role", "img");
    const bw = (W - pad - right) / bins;
    const rect = (x, y, w, hh, cls) => {
      const r = document.createElementNS(svgNS, "rect");
      r.setAttribute("x", x); r.setAttribute("y", y); r.setAttribute("width", Math.max(0, w)); r.setAttribute("height", hh);
      r.setAttribute("class", cls); svg.append(r);
    };
    const text = (x, y, s, anchor) => {
      const t = document.createElementNS(svgNS, "text");
      t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("text-anchor", anchor || "middle");
      t.textContent = s; svg.append(t);
    };
    for (let i = 0; i < bins; i++) {
      const x = pad + i * bw, hk = (h.kept[i] / top) * H, hd = (h.dropped[i] / top) * H;
      rect(x + 1, H - hk, bw - 2, hk, "kept");
      rect(x + 1, H - hk - hd, bw - 2, hd, "dropped");
    }
    for (const v of [0, 0.25, 0.5, 0.75, 1]) text(pad + v * (W - pad - right), H + 16, String(v));
    text(pad - 4, 12, int(top), "end");
    if (meta.cut != null) {
      const x = pad + meta.cut * (W - pad - right);
      const l = document.createElementNS(svgNS, "line");
      l.setAttribute("x1", x); l.setAttribute("x2", x); l.setAttribute("y1", 0); l.setAttribute("y2", H);
      l.setAttribute("class", "cut"); svg.append(l);
      text(x + 4, 12, `threshold ${meta.cut}`, "start");
    }
    $("hist").replaceChildren(svg);
    $("cut-note").textContent = meta.cut_note || "";
    $("cut-note").parentElement.hidden = !meta.cut_note;
    const rows = doc.worst_groups.map((g) => el("tr", {},
      el("td", {}, el("a", { href: "#records", text: g.group || "(all)",
        onclick: (e) => { e.preventDefault(); setFilter({ group: g.group }); } })),
      el("td", { cls: "num", text: int(g.records) }), el("td", { cls: "num", text: int(g.dropped) }),
      el("td", { cls: "num", text: `${Math.round((100 * g.dropped) / g.records)}%` })));
    $("worst").replaceChildren(...rows);
  }

  // ---------------------------------------------------------------- the records
  const state = { q: "", reason: "", state: "", group: "", sort: "input", page: 0, size: 100 };
  if (!doc.present.pinned) $("state").querySelector("option[value=pinned]").remove();
  const selected = new Set();
  let lower = null;  // lower-cased texts, made on the first search
  let shown = [];

  function matches(i) {
    if (state.group && R.group[i] !== state.group) return false;
    if (state.state === "kept" && !R.keep[i]) return false;
    if (state.state === "dropped" && R.keep[i]) return false;
    if (state.state === "pinned" && !R.pinned[i]) return false;
    if (state.reason && (R.keep[i] || (R.reason[i] || "dropped") !== state.reason)) return false;
    if (state.q) {
      const q = state.q.toLowerCase();
      if (lower[i].indexOf(q) < 0 && R.id[i].toLowerCase() !== q) return false;
    }
    return true;
  }

  const sorts = {
    input: null,
    "score-desc": (a, b) => (R.score[b] ?? -1) - (R.score[a] ?? -1) || a - b,
    "score-asc": (a, b) => (R.score[a] ?? 2) - (R.score[b] ?? 2) || a - b,
    "age-desc": (a, b) => (age(b) ?? -Infinity) - (age(a) ?? -Infinity) || a - b,
    "tokens-desc": (a, b) => (R.tokens[b] ?? -1) - (R.tokens[a] ?? -1) || a - b,
  };

  function refilter() {
    if (state.q && lower === null) lower = R.text.map((t) => t.toLowerCase());
    shown = [];
    for (let i = 0; i < N; i++) if (matches(i)) shown.push(i);
    if (sorts[state.sort]) shown.sort(sorts[state.sort]);
    render();
  }

  const short = (t) => (t.length > 70 ? t.slice(0, 69) + "…" : t);
  function link(i, cls) {  // to record i, shown by its text (its id on hover)
    return el("a", { href: "#records", cls, "data-target": R.id[i], title: R.id[i], text: short(R.text[i]),
      onclick: (e) => { e.preventDefault(); focus(i); } });
  }

  function row(i) {
    const box = el("input", { type: "checkbox", checked: selected.has(R.id[i]),
      onchange: (e) => { if (e.target.checked) selected.add(R.id[i]); else selected.delete(R.id[i]); selection(); } });
    const fate = R.keep[i] ? el("span", { cls: "kept", text: R.pinned[i] ? "kept (pinned)" : "kept" })
      : el("span", { cls: "dropped", text: R.reason[i] || "dropped" });
    const links = el("div", { cls: "links" });
    for (const [col, word] of [["duplicate_of", "duplicate of: "], ["superseded_by", "superseded by: "]]) {
      const t = R[col][i];
      if (t != null && byId.has(t)) links.append(el("div", {}, word, link(byId.get(t), "replaced-by")));
    }
    for (const j of replaces.get(i) || []) {
      links.append(el("div", {}, R.superseded_by[j] === R.id[i] ? "supersedes: " : "represents: ",
        link(j, "replaces")));
    }
    return el("tr", { cls: "rec" + (R.keep[i] ? "" : " is-dropped"), "data-id": R.id[i], id: "r-" + i },
      el("td", {}, box), el("td", { cls: "grp", text: R.group[i] }), el("td", { cls: "rid", text: R.id[i] }),
      el("td", { cls: "txt", text: R.text[i] }), el("td", { cls: "num", text: fmt(R.score[i]) }),
      el("td", { cls: "num eff", text: fmt(R.effective[i]) }), el("td", {}, fate, links),
      el("td", { cls: "num tm", text: day(R.time[i]) }), el("td", { cls: "num tok", text: int(R.tokens[i]) }));
  }

  function render() {
    const pages = Math.max(1, Math.ceil(shown.length / state.size));
    state.page = Math.min(state.page, pages - 1);
    const from = state.page * state.size;
    const rows = shown.slice(from, from + state.size).map(row);
    $("rows").replaceChildren(...rows);
    $("shown").textContent = `${int(shown.length)} of ${int(N)} records`;
    $("shown").setAttribute("data-n", shown.length);
    $("page").textContent = `page ${state.page + 1} of ${pages}`;
    $("prev").disabled = state.page === 0;
    $("next").disabled = state.page >= pages - 1;
    hideAbsent();
  }

  function hideAbsent() {  // the columns no record has a value in (effective score, time, tokens)
    for (const [f, cls] of [["effective", "eff"], ["time", "tm"], ["tokens", "tok"]]) {
      document.querySelectorAll("#records ." + cls).forEach((e) => { e.hidden = !doc.present[f]; });
    }
  }

  function selection() {
    $("selected").textContent = `${int(selected.size)} selected`;
    $("export").disabled = selected.size === 0;
  }

  function setFilter(f) {
    Object.assign(state, { q: "", reason: "", state: "", group: "", page: 0 }, f);
    $("q").value = state.q; $("reason").value = state.reason; $("state").value = state.state;
    $("group").value = state.group;
    refilter();
    $("records").scrollIntoView();
  }

  function focus(i) {
    setFilter({ group: R.group[i] });
    const at = shown.indexOf(i);
    if (at >= 0) { state.page = Math.floor(at / state.size); render(); }
    const tr = $("r-" + i);
    if (tr) { tr.classList.add("focus"); tr.scrollIntoView({ block: "center" }); }
  }

  function controls() {
    if (!doc.present.time) $("sort").querySelector("option[value=age-desc]").remove();
    if (!doc.present.tokens) $("sort").querySelector("option[value=tokens-desc]").remove();
    const reasons = Object.keys(doc.counts.by_reason).sort();
    $("reason").replaceChildren(el("option", { value: "", text: "any reason" }),
      ...reasons.map((r) => el("option", { value: r, text: r })));
    $("groups").replaceChildren(...doc.group_names.map((g) => el("option", { value: g })));
    let timer = null;
    $("q").addEventListener("input", (e) => {
      clearTimeout(timer);
      timer = setTimeout(() => { state.q = e.target.value.trim(); state.page = 0; refilter(); }, 120);
    });
    for (const k of ["reason", "state", "sort", "group"]) {
      $(k).addEventListener("change", (e) => { state[k] = e.target.value; state.page = 0; refilter(); });
    }
    $("prev").addEventListener("click", () => { state.page--; render(); });
    $("next").addEventListener("click", () => { state.page++; render(); });
    $("select-shown").addEventListener("click", () => { shown.forEach((i) => selected.add(R.id[i])); selection(); render(); });
    $("select-none").addEventListener("click", () => { selected.clear(); selection(); render(); });
    $("export").addEventListener("click", () => {
      const ids = R.id.filter((id) => selected.has(id));
      const a = el("a", { href: URL.createObjectURL(new Blob([ids.join("\n") + "\n"], { type: "text/plain" })) });
      a.download = "memprune-ids.txt";
      document.body.append(a); a.click(); a.remove();
    });
  }

  summary();
  histogram();
  controls();
  selection();
  refilter();
  document.body.setAttribute("data-ready", "1");
})();
