// pslaunch job page: the live view of one job. Vanilla ES2020, no dependency, no network but this
// page's own origin (the Content-Security-Policy allows nothing else). Data: the snapshot
// (GET /api/state, or the SSE `snapshot` event) and the SSE events of /events (see the contract in
// the launcher's notes: `lines`, `procs`, `job`, `points`, `failure`). Events only change the model
// and mark what is dirty; one requestAnimationFrame pass writes the DOM, so 256 processes printing
// fast cost one batched update per 100 ms, and the table is patched cell by cell, never rebuilt.
'use strict';
(() => {
  // Bounds: what the page holds and shows, whatever the job prints.
  const PANE_LINES = 5000;      // lines in the log pane's DOM at most
  const PROC_LINES = 1000;      // lines the page keeps per process for filters and search (the launcher's ring too)
  const SERIES_POINTS = 1200;   // throughput points kept per process (older ones thinned, never all dropped)
  const CHART_MS = 500;         // the chart is redrawn at most this often
  const FRAME_MS = 100;         // the table and the log pane are written at most this often
  const POLL_MS = 2000;         // /api/state polling when the event stream keeps failing
  const SSE_FAILS = 3;          // consecutive stream errors before polling
  const FINAL = new Set(['succeeded', 'failed', 'stopped']);
  const PALETTE = ['#2563eb', '#16a34a', '#dc2626', '#9333ea', '#ea580c', '#0891b2', '#c026d3', '#65a30d',
    '#b45309', '#4f46e5', '#db2777', '#0d9488'];

  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };

  // ---- the model ----
  const M = {
    job: null, jobAt: 0,            // the job object, and performance.now() when it came
    procs: new Map(),               // name -> row (the contract's process object)
    order: [],                      // names in the launcher's order (scheduler, servers, workers by rank)
    series: new Map(),              // name -> [[t, v], ...]
    failure: null,
    held: [],                       // [{name, seq, t, s, text, dead}] in arrival order; dead: dropped from its process
    byProc: new Map(),              // name -> its held lines, at most PROC_LINES (a chatty process cannot push out a quiet one's)
    dead: 0,
    lastSeq: new Map(),             // name -> highest seq held (a replayed or polled line is not shown twice)
  };
  const dirty = { rows: new Set(), job: false, failure: false, chart: false, pane: false, filters: false, summary: false };
  let newLines = [];                // held lines not yet in the pane
  let frame = 0;

  // ---- formatting ----
  const fmtDur = (s) => {
    if (s == null || !isFinite(s) || s < 0) return '';
    s = Math.floor(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    const p2 = (n) => String(n).padStart(2, '0');
    return h ? `${h}:${p2(m)}:${p2(sec)}` : `${m}:${p2(sec)}`;
  };
  const fmtBytes = (b) => {
    if (b == null) return '';
    const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return (i && b < 10 ? b.toFixed(1) : Math.round(b)) + ' ' + u[i];
  };
  const fmtNum = (v) => {
    if (v == null || !isFinite(v)) return '';
    const a = Math.abs(v);
    if (a >= 1000) return Math.round(v).toLocaleString('en-US');
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    return v.toFixed(2);
  };
  const fmtCpu = (c) => (c == null ? '' : (c >= 100 ? c.toFixed(0) : c.toFixed(1)) + '%');
  const exitText = (p) => {
    const parts = [];
    if (p.exit_code != null) parts.push(String(p.exit_code));
    if (p.signal) parts.push(p.signal);
    return parts.join(' ');
  };
  const labelOf = (name) => { const p = M.procs.get(name); return (p && p.label) || name; };

  // ---- applying data ----
  function applySnapshot(s) {
    if (!s) return;
    if (s.job) applyJob(s.job);
    applyProcs(s.processes || [], true);
    if (s.throughput) {
      M.series.clear();
      for (const [name, pts] of Object.entries(s.throughput)) {
        let p = pts.slice();
        while (p.length > SERIES_POINTS) p = thin(p);
        M.series.set(name, p);
      }
      dirty.chart = true;
    }
    applyFailure(s.failure || null);
    if (s.logs) {
      const fresh = [];
      for (const [name, lines] of Object.entries(s.logs)) {
        for (const [seq, t, st, text] of lines) fresh.push([name, seq, t, st, text]);
      }
      fresh.sort((a, b) => (a[2] - b[2]) || (a[1] - b[1]));
      applyLines(fresh);
    }
    schedule();
  }

  function applyJob(j) {
    M.job = j;
    M.jobAt = performance.now();
    dirty.job = true;
    dirty.chart = true;
    schedule();
  }

  function applyProcs(rows, fromSnapshot) {
    let added = false;
    for (const r of rows) {
      if (!M.procs.has(r.name)) { M.order.push(r.name); added = true; }
      M.procs.set(r.name, r);
      dirty.rows.add(r.name);
    }
    if (fromSnapshot && rows.length) {
      // the snapshot's order is the launcher's: keep it for the default sort
      const seen = new Set(rows.map((r) => r.name));
      M.order = rows.map((r) => r.name).concat(M.order.filter((n) => !seen.has(n)));
    }
    if (added) dirty.filters = true;
    dirty.summary = true;
    schedule();
  }

  function applyFailure(f) {
    M.failure = f;
    dirty.failure = true;
    schedule();
  }

  function applyLines(lines) {
    for (const [name, seq, t, st, text] of lines) {
      if (seq <= (M.lastSeq.get(name) || 0)) continue;
      M.lastSeq.set(name, seq);
      const rec = { name, seq, t, s: st, text: String(text), dead: false };
      M.held.push(rec);
      newLines.push(rec);
      let mine = M.byProc.get(name);
      if (!mine) { mine = []; M.byProc.set(name, mine); }
      mine.push(rec);
      if (mine.length > PROC_LINES * 1.2) {
        const cut = mine.length - PROC_LINES;
        for (let i = 0; i < cut; i++) mine[i].dead = true;
        M.dead += cut;
        M.byProc.set(name, mine.slice(cut));
      }
    }
    if (M.dead > M.held.length / 2) { M.held = M.held.filter((r) => !r.dead); M.dead = 0; }
    if (newLines.length > PANE_LINES) { newLines = []; dirty.pane = true; } // too many: rebuild from held
    schedule();
  }

  /** Halves the older three quarters of a series: the chart keeps the whole job, the newest part at full detail. */
  function thin(s) {
    const keep = s.length >> 2, out = [];
    for (let i = 0; i < s.length - keep; i += 2) out.push(s[i]);
    for (let i = s.length - keep; i < s.length; i++) out.push(s[i]);
    return out;
  }

  function applyPoints(points) {
    for (const [name, t, v] of points) {
      let s = M.series.get(name);
      if (!s) { s = []; M.series.set(name, s); }
      s.push([t, v]);
      if (s.length > SERIES_POINTS) M.series.set(name, thin(s));
    }
    dirty.chart = true;
    schedule();
  }

  // ---- the frame: every DOM write happens here ----
  // At most one DOM pass per FRAME_MS: with hundreds of processes printing, fewer, larger passes
  // cost far less layout than one per animation frame, and 100 ms is well inside the 1 s budget.
  let lastFlush = 0, flushTimer = 0;
  function schedule() {
    if (frame || flushTimer) return;
    const wait = FRAME_MS - (performance.now() - lastFlush);
    if (wait > 0) flushTimer = setTimeout(() => { flushTimer = 0; frame = requestAnimationFrame(flush); }, wait);
    else frame = requestAnimationFrame(flush);
  }

  function flush() {
    frame = 0;
    lastFlush = performance.now();
    if (dirty.job) { dirty.job = false; renderJob(); }
    if (dirty.failure) { dirty.failure = false; renderFailure(); }
    if (dirty.filters) { dirty.filters = false; renderFilterOptions(); }
    if (dirty.rows.size) { renderRows(); }
    if (dirty.summary) { dirty.summary = false; renderSummary(); }
    if (dirty.pane) { dirty.pane = false; newLines = []; rebuildPane(); } else if (newLines.length) { appendPane(); }
    if (dirty.chart) maybeChart();
  }

  // ---- header ----
  function elapsedNow() {
    const j = M.job;
    if (!j) return null;
    if (FINAL.has(j.state) && j.end != null && j.start != null) return j.end - j.start;
    if (FINAL.has(j.state)) return j.elapsed;
    return (j.elapsed || 0) + (performance.now() - M.jobAt) / 1000;
  }

  function renderJob() {
    const j = M.job;
    if (!j) return;
    $('job-id').textContent = j.id || '';
    $('job-id').title = j.id || '';
    $('job-command').textContent = j.command || '';
    $('job-command').title = j.command || '';
    $('job-tracker').textContent = j.tracker || '';
    $('job-backend').textContent = j.backend || '';
    const st = $('job-state');
    st.textContent = j.state || '';
    st.className = 'badge state-' + (j.state || 'unknown');
    const k = (j.attempt || 0) + 1, n = (j.max_restarts || 0) + 1;
    $('job-attempt').textContent = `${k}/${n}`;
    $('job-attempt').title = n > 1 ? `attempt ${k} of at most ${n} (--max-restarts ${n - 1})` : 'no restarts';
    $('job-elapsed').textContent = fmtDur(elapsedNow());
    document.title = `${j.state} · ${j.id || 'job'} · pslaunch`;
    renderAttempts(j.attempts || []);
    if (FINAL.has(j.state)) setConn(conn.mode === 'live' || conn.mode === 'polling' ? 'ended' : conn.mode);
  }

  function renderAttempts(list) {
    const box = $('attempts');
    if (list.length < 2) { box.hidden = true; return; }
    const ol = $('attempts-list');
    ol.textContent = '';
    for (const a of list) {
      const li = el('li');
      li.append(el('b', '', `#${a.attempt + 1}`), ` ${fmtDur(a.start != null && M.job ? a.start - M.job.start : null)}`);
      const why = a.reason || (a.cause && (a.cause.headline || a.cause.name)) || '';
      const code = a.exit_code != null ? ` exit ${a.exit_code}` : '';
      if (why || code) li.append(` · ${why}${code}`);
      if (a.hosts) li.append(` · hosts: ${a.hosts}`);
      if (a.end == null) li.append(' · running');
      ol.append(li);
    }
    box.hidden = false;
  }

  function tick() {
    if (M.job) {
      const t = fmtDur(elapsedNow());
      const e = $('job-elapsed');
      if (e.textContent !== t) e.textContent = t;
      if (!FINAL.has(M.job.state)) { dirty.chart = true; schedule(); } // the time axis moves on
    }
  }

  // ---- failure ----
  function renderFailure() {
    const f = M.failure, box = $('failure');
    if (!f) { box.hidden = true; return; }
    $('failure-headline').textContent = f.headline || f.name || '';
    $('failure-lines').textContent = (f.lines || []).join('\n');
    const p = M.procs.get(f.name);
    const a = $('failure-log');
    if (M.job && M.job.logs && p && p.log) { a.href = '/logs/' + encodeURIComponent(p.log); a.hidden = false; } else a.hidden = true;
    box.hidden = false;
    const pre = $('failure-lines');
    pre.scrollTop = pre.scrollHeight;
  }

  // ---- process table ----
  const COLS = ['role', 'rank', 'host', 'pid', 'state', 'exit', 'cpu', 'rss', 'speed', 'lines', 'last', 'links'];
  const NUMERIC = new Set(['rank', 'pid', 'exit', 'cpu', 'rss', 'speed', 'lines']);
  const rowEls = new Map();         // name -> {tr, cells: {col: td}, vals: {col: text}}
  const sort = { key: null, desc: false };

  function makeRow(name) {
    const tr = el('tr');
    tr.dataset.name = name;
    const cells = {};
    for (const c of COLS) {
      const td = el('td', NUMERIC.has(c) ? c + ' num' : c);
      tr.append(td);
      cells[c] = td;
    }
    const r = { tr, cells, vals: {}, cls: '' };
    rowEls.set(name, r);
    return r;
  }

  function setCell(r, col, text, title) {
    if (r.vals[col] === text) return;
    r.vals[col] = text;
    r.cells[col].textContent = text;
    if (title !== undefined) r.cells[col].title = title;
  }

  function renderRows() {
    const tbody = $('procs').tBodies[0];
    let created = false;
    const logs = !!(M.job && M.job.logs);
    const fastest = Math.max(0, ...[...M.procs.values()].map((p) => p.speed || 0));
    for (const name of dirty.rows) {
      const p = M.procs.get(name);
      if (!p) continue;
      let r = rowEls.get(name);
      if (!r) { r = makeRow(name); created = true; }
      setCell(r, 'role', p.role || '');
      setCell(r, 'rank', p.rank == null ? '' : String(p.rank));
      setCell(r, 'host', p.host || '', p.host || '');
      setCell(r, 'pid', p.pid == null ? '' : String(p.pid));
      setCell(r, 'state', p.state || '');
      setCell(r, 'exit', exitText(p));
      setCell(r, 'cpu', fmtCpu(p.cpu));
      r.cells.cpu.classList.toggle('hot', p.cpu != null && p.cpu >= 95);
      setCell(r, 'rss', fmtBytes(p.rss), p.rss == null ? '' : `${p.rss.toLocaleString('en-US')} bytes`);
      const ep = p.epoch != null ? `epoch ${p.epoch}` + (p.batch != null ? `, batch ${p.batch}` : '') : '';
      setCell(r, 'speed', fmtNum(p.speed), ep);
      // a worker well below the fastest one is the one to look at
      r.cells.speed.classList.toggle('slow', p.state === 'running' && p.speed != null && fastest > 0 && p.speed < 0.7 * fastest);
      setCell(r, 'lines', p.lines == null ? '' : p.lines.toLocaleString('en-US'));
      setCell(r, 'last', p.last_line || '', p.last_line || '');
      const logKey = logs && p.log ? p.log : '';
      if (r.vals.links !== logKey) {
        r.vals.links = logKey;
        r.cells.links.textContent = '';
        if (logKey) {
          const a = el('a', 'log-link', 'log');
          a.href = '/logs/' + encodeURIComponent(logKey);
          a.target = '_blank';
          a.rel = 'noopener';
          a.title = `the full log of ${p.label || name} (${logKey})`;
          r.cells.links.append(a);
        }
      }
      const cls = 'state-' + (p.state || 'unknown') + (selected === name ? ' selected' : '');
      if (r.cls !== cls) { r.cls = cls; r.tr.className = cls; }
    }
    const sortedChanged = sort.key && [...dirty.rows].length > 0;
    dirty.rows.clear();
    if (created || sortedChanged) placeRows(tbody);
  }

  function sortValue(p, key) {
    switch (key) {
      case 'exit': return p.exit_code != null ? p.exit_code : (p.signal ? -1000 : null);
      case 'state': return ['failed', 'restarting', 'starting', 'running', 'stopped', 'succeeded'].indexOf(p.state);
      default: return p[key];
    }
  }

  function orderedNames() {
    const names = M.order.filter((n) => M.procs.has(n));
    if (!sort.key) return names;
    const idx = new Map(names.map((n, i) => [n, i]));
    const k = sort.key, dir = sort.desc ? -1 : 1;
    return names.slice().sort((a, b) => {
      const va = sortValue(M.procs.get(a), k), vb = sortValue(M.procs.get(b), k);
      if (va == null && vb != null) return 1;   // blanks last, whatever the direction
      if (vb == null && va != null) return -1;
      if (va != null && vb != null && va !== vb) return (va < vb ? -1 : 1) * dir;
      return idx.get(a) - idx.get(b);
    });
  }

  let placed = [];
  function placeRows(tbody) {
    const names = orderedNames();
    if (names.length === placed.length && names.every((n, i) => n === placed[i])) return;
    const frag = document.createDocumentFragment();
    for (const n of names) { const r = rowEls.get(n); if (r) frag.append(r.tr); }
    tbody.append(frag);                 // moves the rows; their cells stay as they are
    placed = names;
  }

  function renderSummary() {
    const counts = {};
    for (const p of M.procs.values()) counts[p.state] = (counts[p.state] || 0) + 1;
    const box = $('proc-summary');
    box.textContent = '';
    box.append(el('b', '', String(M.procs.size)), ' processes');
    for (const s of ['running', 'starting', 'failed', 'stopped', 'succeeded']) {
      if (counts[s]) box.append(' · ', el('b', '', String(counts[s])), ' ' + s);
    }
  }

  function onSortClick(ev) {
    const th = ev.target.closest('th[data-sort]');
    if (!th) return;
    const key = th.dataset.sort;
    if (sort.key === key) {
      if (!sort.desc) sort.desc = true; else { sort.key = null; sort.desc = false; }
    } else { sort.key = key; sort.desc = ['cpu', 'rss', 'speed', 'lines'].includes(key); }
    for (const h of $('procs').tHead.rows[0].cells) {
      h.classList.toggle('sorted', h.dataset.sort === sort.key);
      h.classList.toggle('desc', h.dataset.sort === sort.key && sort.desc);
    }
    placed = [];
    placeRows($('procs').tBodies[0]);
  }

  let selected = null;
  function onRowClick(ev) {
    if (ev.target.closest('a')) return;
    const tr = ev.target.closest('tr[data-name]');
    if (!tr) return;
    showProcess(tr.dataset.name);
  }

  /** Filters the log pane to one process (its role and rank, or its host when it has no rank). */
  function showProcess(name) {
    const p = M.procs.get(name);
    if (!p) return;
    const prev = selected;
    selected = selected === name ? null : name;
    $('filter-role').value = selected ? (p.role || '') : '';
    $('filter-rank').value = selected && p.rank != null ? String(p.rank) : '';
    $('filter-host').value = selected && p.rank == null ? (p.host || '') : '';
    if (prev) dirty.rows.add(prev);
    dirty.rows.add(name);
    onFilter();
  }

  // ---- filters ----
  const filt = { role: '', ranks: null, host: '' };

  function parseRanks(text) {
    text = text.trim();
    if (!text) return null;
    const set = new Set();
    for (const part of text.split(/[\s,]+/)) {
      const m = /^(\d+)(?:\s*-\s*(\d+))?$/.exec(part);
      if (!m) continue;
      const a = +m[1], b = m[2] != null ? +m[2] : a;
      for (let i = Math.min(a, b); i <= Math.max(a, b) && set.size < 100000; i++) set.add(i);
    }
    return set;
  }

  function renderFilterOptions() {
    const roles = new Set(), hosts = new Set();
    for (const p of M.procs.values()) { if (p.role) roles.add(p.role); if (p.host) hosts.add(p.host); }
    fillSelect($('filter-role'), 'all roles', ['scheduler', 'server', 'worker'].filter((r) => roles.has(r))
      .concat([...roles].filter((r) => !['scheduler', 'server', 'worker'].includes(r)).sort()));
    fillSelect($('filter-host'), 'all hosts', [...hosts].sort());
  }

  function fillSelect(sel, allText, values) {
    const have = [...sel.options].slice(1).map((o) => o.value);
    if (have.length === values.length && have.every((v, i) => v === values[i])) return;
    const cur = sel.value;
    sel.textContent = '';
    sel.append(new Option(allText, ''));
    for (const v of values) sel.append(new Option(v, v));
    sel.value = values.includes(cur) ? cur : '';
  }

  function passes(rec) {
    if (filt.role || filt.ranks || filt.host) {
      const p = M.procs.get(rec.name);
      if (filt.role && (!p || p.role !== filt.role)) return false;
      if (filt.ranks && (!p || p.rank == null || !filt.ranks.has(p.rank))) return false;
      if (filt.host && (!p || p.host !== filt.host)) return false;
    }
    if (search.only && search.q && !rec.text.toLowerCase().includes(search.q)) return false;
    return true;
  }

  function onFilter() {
    filt.role = $('filter-role').value;
    filt.ranks = parseRanks($('filter-rank').value);
    filt.host = $('filter-host').value;
    dirty.pane = true;
    schedule();
  }

  // ---- the log pane ----
  const pane = () => $('log');
  let follow = true;
  let shownCount = 0;               // .line elements in the pane
  let matchedHeld = 0;              // with "matching only": lines held that match (may exceed the pane)

  function lineEl(rec) {
    const d = el('div', rec.s === 'e' ? 'line err' : 'line');
    d.dataset.name = rec.name;
    d.append(el('span', 't', fmtDur(rec.t)), el('span', 'src', `[${labelOf(rec.name)}]`));
    const txt = el('span', 'txt');
    fillText(txt, rec.text);
    d.append(txt);
    if (rec.s === 'e') d.title = 'stderr';
    return d;
  }

  /** Writes text into a span, each case-insensitive match of the search in a <mark>. */
  function fillText(span, text) {
    span.textContent = '';
    const q = search.q;
    if (!q) { span.textContent = text; return 0; }
    const low = text.toLowerCase();
    let i = 0, n = 0, j;
    while ((j = low.indexOf(q, i)) !== -1) {
      if (j > i) span.append(text.slice(i, j));
      span.append(el('mark', '', text.slice(j, j + q.length)));
      i = j + q.length;
      n++;
    }
    if (i < text.length) span.append(text.slice(i));
    return n;
  }

  function rebuildPane() {
    const box = pane();
    const out = [];
    matchedHeld = 0;
    for (let i = M.held.length - 1; i >= 0; i--) {
      if (!M.held[i].dead && passes(M.held[i])) { matchedHeld++; if (out.length < PANE_LINES) out.push(M.held[i]); }
    }
    out.reverse();
    const frag = document.createDocumentFragment();
    if (matchedHeld > out.length) frag.append(el('div', 'note', `${(matchedHeld - out.length).toLocaleString('en-US')} earlier lines not shown: narrow the filters, or open a full log`));
    for (const rec of out) frag.append(lineEl(rec));
    box.textContent = '';
    box.append(frag);
    shownCount = out.length;
    current = null;
    afterPaneChange();
  }

  function appendPane() {
    const box = pane();
    const add = newLines.filter(passes);
    newLines = [];
    if (!add.length) return;
    const frag = document.createDocumentFragment();
    for (const rec of add) frag.append(lineEl(rec));
    box.append(frag);
    shownCount += add.length;
    matchedHeld += add.length;
    // keep the pane bounded: drop the oldest lines (a note stays first)
    let drop = shownCount - PANE_LINES;
    if (drop > 0) {
      const top = box.scrollTop;
      const h0 = box.scrollHeight;
      let note = box.firstElementChild && box.firstElementChild.classList.contains('note') ? box.firstElementChild : null;
      let n = note ? note.nextElementSibling : box.firstElementChild;
      while (drop > 0 && n) { const next = n.nextElementSibling; if (n === current) current = null; n.remove(); n = next; drop--; shownCount--; }
      if (!note) { note = el('div', 'note'); box.prepend(note); }
      note.textContent = `${(matchedHeld - shownCount).toLocaleString('en-US')} earlier lines not shown: narrow the filters, or open a full log`;
      if (!follow) box.scrollTop = Math.max(0, top - (h0 - box.scrollHeight));
    }
    afterPaneChange();
  }

  function afterPaneChange() {
    const box = pane();
    if (follow) box.scrollTop = box.scrollHeight;
    updateCount();
    const s = $('log-summary');
    const total = M.held.length - M.dead;
    s.textContent = `${shownCount.toLocaleString('en-US')} shown of ${total.toLocaleString('en-US')} held`;
  }

  function onLogScroll() {
    const box = pane();
    const atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
    if (atEnd !== follow) { follow = atEnd; $('follow').checked = follow; }
  }

  // ---- search ----
  const search = { q: '', only: false };
  let current = null;               // the current <mark>
  const marks = () => pane().getElementsByTagName('mark');   // live: always what the pane holds

  function onSearchInput() {
    const q = $('search').value.toLowerCase();
    if (q === search.q) return;
    search.q = q;
    current = null;
    if (search.only) { dirty.pane = true; schedule(); return; }
    // re-mark the lines already in the pane (at most PANE_LINES)
    const box = pane();
    for (const d of box.querySelectorAll('.line')) {
      const span = d.lastElementChild;
      fillText(span, span.textContent);
    }
    updateCount();
  }

  function updateCount() {
    const c = $('search-count');
    if (!search.q) { c.textContent = ''; c.classList.remove('none'); return; }
    const ms = marks();
    const n = ms.length;
    const i = current ? Array.prototype.indexOf.call(ms, current) : -1;
    c.textContent = n === 0 ? 'no matches' : (i >= 0 ? `${i + 1} of ${n}` : `${n} match${n === 1 ? '' : 'es'}`);
    c.classList.toggle('none', n === 0);
  }

  function setCurrent(m, scroll) {
    if (current) current.classList.remove('current');
    current = m;
    if (!m) return;
    m.classList.add('current');
    if (scroll) {
      follow = false;
      $('follow').checked = false;
      m.scrollIntoView({ block: 'center', inline: 'nearest' });
    }
  }

  function step(d) {
    const ms = marks();
    if (!ms.length) { updateCount(); return; }
    let i = current ? Array.prototype.indexOf.call(ms, current) : -1;
    i = i < 0 ? (d > 0 ? 0 : ms.length - 1) : (i + d + ms.length) % ms.length;
    setCurrent(ms[i], true);
    updateCount();
  }

  // ---- chart ----
  let lastChart = 0, chartTimer = 0;

  function maybeChart() {
    const wait = CHART_MS - (performance.now() - lastChart);
    if (wait > 0) { if (!chartTimer) chartTimer = setTimeout(() => { chartTimer = 0; schedule(); }, wait); return; }
    dirty.chart = false;
    lastChart = performance.now();
    drawChart();
  }

  function niceStep(range, n) {
    const raw = range / Math.max(1, n);
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }
  const niceTimeStep = (range, n) => {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
    const raw = range / Math.max(1, n);
    return steps.find((s) => s >= raw) || 86400;
  };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));

  /** The typical gap between one process's points: a point older than 3 gaps no longer counts in the total. */
  function staleAfter(pts) {
    const n = pts.length;
    if (n < 3) return 30;
    const gaps = [];
    for (let i = Math.max(1, n - 21); i < n; i++) gaps.push(pts[i][0] - pts[i - 1][0]);
    gaps.sort((a, b) => a - b);
    return Math.max(5, 3 * gaps[gaps.length >> 1]);
  }

  function drawChart() {
    const box = $('chart');
    const names = [...M.series.keys()].filter((n) => M.series.get(n).length)
      .sort((a, b) => M.order.indexOf(a) - M.order.indexOf(b));
    const withTotal = names.length > 1;
    const W = Math.max(320, box.clientWidth - 16 || 600), H = 290;
    const L = 50, R = withTotal ? 62 : 14, T = 14, B = 30;
    const pw = W - L - R, ph = H - T - B;
    let npts = 0, tmax = 0, vmax = 0;
    for (const n of names) {
      const s = M.series.get(n);
      npts += s.length;
      tmax = Math.max(tmax, s[s.length - 1][0]);
      for (const p of s) if (p[1] > vmax) vmax = p[1];
    }
    const el0 = elapsedNow();
    if (el0 != null) tmax = Math.max(tmax, el0);
    const tnow = tmax;               // the total stops here: a last point is not held into the future
    tmax = Math.max(tmax, 10);
    // buckets for the total (and to thin long series): one per 2 px
    const nb = Math.max(10, Math.floor(pw / 2));
    const bw = tmax / nb;
    const total = new Float64Array(nb + 1);
    const counted = new Uint8Array(nb + 1);
    const starts = attemptStarts();
    const paths = [];
    for (const n of names) {
      const s = M.series.get(n), stale = staleAfter(s);
      // the total at a bucket's end: each process's newest point there, held until its next point in
      // the same attempt; after its last point it counts for `stale` seconds only (it may have ended)
      let j = -1;
      for (let b = 0; b <= nb; b++) {
        const tb = b * bw;
        if (tb > tnow + bw) break;
        while (j + 1 < s.length && s[j + 1][0] <= tb + 1e-9) j++;
        if (j < 0) continue;
        const a = attemptOf(starts, s[j][0]);
        if (a !== attemptOf(starts, tb)) continue;
        const next = j + 1 < s.length ? s[j + 1] : null;
        if ((next && attemptOf(starts, next[0]) === a) || tb - s[j][0] <= stale) { total[b] += s[j][1]; counted[b] = 1; }
      }
      paths.push([n, seriesPath(s, stale, starts, bw)]);
    }
    let tv = 0;
    for (let b = 0; b <= nb; b++) if (counted[b] && total[b] > tv) tv = total[b];
    // per process on the left axis; the total, much larger with many workers, on its own right axis
    const ymax = Math.max(vmax, 1) * 1.1, tmaxV = Math.max(tv, 1) * 1.1;
    const X = (t) => L + (t / tmax) * pw, Y = (v) => T + ph - (v / ymax) * ph, Yt = (v) => T + ph - (v / tmaxV) * ph;
    const out = [`<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" role="img" aria-label="samples per second over time">`];
    const ys = niceStep(ymax, 5);
    for (let v = 0; v <= ymax + 1e-9; v += ys) {
      const y = Y(v).toFixed(1);
      out.push(`<line class="grid" x1="${L}" x2="${L + pw}" y1="${y}" y2="${y}"/>`);
      out.push(`<text class="tick" x="${L - 6}" y="${(+y + 3.5).toFixed(1)}" text-anchor="end">${esc(fmtAxis(v))}</text>`);
    }
    if (withTotal) {
      const ts = niceStep(tmaxV, 5);
      for (let v = 0; v <= tmaxV + 1e-9; v += ts) {
        const y = Yt(v).toFixed(1);
        out.push(`<line class="axis" x1="${L + pw}" x2="${L + pw + 4}" y1="${y}" y2="${y}"/>`);
        out.push(`<text class="tick tick-total" x="${L + pw + 7}" y="${(+y + 3.5).toFixed(1)}">${esc(fmtAxis(v))}</text>`);
      }
      out.push(`<line class="axis" x1="${L + pw}" x2="${L + pw}" y1="${T}" y2="${T + ph}"/>`);
      out.push(`<text class="axis-label tick-total" transform="translate(${W - 10} ${T + ph / 2}) rotate(90)" text-anchor="middle">total samples/s</text>`);
    }
    const xs = niceTimeStep(tmax, Math.max(3, Math.floor(pw / 90)));
    for (let t = 0; t <= tmax + 1e-9; t += xs) {
      const x = X(t).toFixed(1);
      out.push(`<line class="axis" x1="${x}" x2="${x}" y1="${T + ph}" y2="${T + ph + 4}"/>`);
      out.push(`<text class="tick" x="${x}" y="${T + ph + 16}" text-anchor="middle">${esc(fmtDur(t))}</text>`);
    }
    out.push(`<line class="axis" x1="${L}" x2="${L + pw}" y1="${T + ph}" y2="${T + ph}"/>`);
    out.push(`<line class="axis" x1="${L}" x2="${L}" y1="${T}" y2="${T + ph}"/>`);
    out.push(`<text class="axis-label" transform="translate(11 ${T + ph / 2}) rotate(-90)" text-anchor="middle">${withTotal ? 'samples/s per process' : 'samples/s'}</text>`);
    out.push(`<text class="axis-label" x="${L}" y="${H - 2}">time since start</text>`);
    for (let i = 1; i < starts.length; i++) {
      const x = X(starts[i]).toFixed(1);
      out.push(`<line class="attempt" x1="${x}" x2="${x}" y1="${T}" y2="${T + ph}"><title>attempt ${i + 1} starts</title></line>`);
      out.push(`<text class="attempt-label" x="${(+x + 4).toFixed(1)}" y="${T + 9}">attempt ${i + 1}</text>`);
    }
    const many = names.length > PALETTE.length;
    paths.forEach(([n, segs], i) => {
      if (!segs.length) return;
      const d = segs.map((seg) => 'M' + seg.map(([t, v]) => `${X(t).toFixed(1)} ${Y(v).toFixed(1)}`).join('L')).join('');
      out.push(`<path class="series${many ? ' many' : ''}" stroke="${PALETTE[i % PALETTE.length]}" d="${d}"><title>${esc(labelOf(n))}</title></path>`);
    });
    if (withTotal) {
      const segs = [];
      let seg = null;
      for (let b = 0; b <= nb; b++) {
        if (counted[b]) { if (!seg) { seg = []; segs.push(seg); } seg.push(`${X(b * bw).toFixed(1)} ${Yt(total[b]).toFixed(1)}`); } else seg = null;
      }
      if (segs.length) out.push(`<path class="total" d="${segs.map((s) => 'M' + s.join('L')).join('')}"><title>total (right axis)</title></path>`);
    }
    if (!names.length) out.push(`<text class="empty" x="${L + pw / 2}" y="${T + ph / 2}" text-anchor="middle">no throughput yet: the workers' Speedometer lines (samples/sec) show here</text>`);
    out.push('</svg>');
    box.innerHTML = out.join('');
    box.dataset.points = String(npts);
    renderLegend(names, many, tv, total, counted, nb);
  }

  function fmtAxis(v) {
    if (v >= 1e6) return (v / 1e6).toFixed(v % 1e6 ? 1 : 0) + 'M';
    if (v >= 1e4) return (v / 1e3).toFixed(0) + 'k';
    if (v >= 1000) return (v / 1e3).toFixed(1) + 'k';
    return String(+v.toFixed(2));
  }

  /** Attempt start times (s since job start), attempt 0 first. */
  function attemptStarts() {
    const j = M.job;
    const out = [0];
    if (!j || !j.attempts) return out;
    for (const a of j.attempts) if (a.attempt > 0 && a.start != null) out.push(Math.max(0, a.start - j.start));
    return out.sort((a, b) => a - b);
  }
  function attemptOf(starts, t) {
    let i = 0;
    while (i + 1 < starts.length && starts[i + 1] <= t) i++;
    return i;
  }

  /** One process's line: thinned to one point per bucket, broken where it has no point for `stale` s. */
  function seriesPath(s, stale, starts, bw) {
    const segs = [];
    let seg = null, prev = null, lastB = -1, prevGap = Infinity;
    for (const p of s) {
      const b = Math.floor(p[0] / bw);
      // a break: a new attempt, or a gap both longer than `stale` and 3 times the one before it
      // (older points are thinned, so a fixed threshold would cut the older part into pieces)
      const gap = prev ? p[0] - prev[0] : 0;
      if (!seg || (gap > stale && gap > 3 * prevGap) || attemptOf(starts, p[0]) !== attemptOf(starts, prev[0])) {
        seg = []; segs.push(seg); lastB = -1;
      }
      prevGap = gap || prevGap;
      if (b === lastB && seg.length) seg[seg.length - 1] = p; else seg.push(p);
      lastB = b;
      prev = p;
    }
    return segs;
  }

  function renderLegend(names, many, tv, total, counted, nb) {
    const lg = $('legend');
    lg.textContent = '';
    let lastTotal = null;
    for (let b = nb; b >= 0; b--) if (counted[b]) { lastTotal = total[b]; break; }
    if (names.length > 1) {
      const it = el('span', 'item total');
      it.append(el('span', 'sw total'), `total ${lastTotal != null ? fmtNum(lastTotal) : ''} (right axis)`);
      lg.append(it);
    }
    const shown = many ? names.slice(0, 24) : names;
    shown.forEach((n, i) => {
      const s = M.series.get(n);
      const it = el('span', 'item');
      const sw = el('span', 'sw');
      sw.style.background = PALETTE[i % PALETTE.length];   // CSSOM, not an inline style attribute
      it.append(sw, `${labelOf(n)} ${fmtNum(s[s.length - 1][1])}`);
      lg.append(it);
    });
    if (shown.length < names.length) lg.append(el('span', 'item', `… and ${names.length - shown.length} more`));
    $('chart-total').textContent = names.length ? `peak total ${fmtNum(tv)} samples/s` : '';
  }

  // ---- the connection: SSE, else polling ----
  const conn = { mode: 'connecting', es: null, fails: 0, poll: 0 };
  function setConn(mode) {
    conn.mode = mode;
    const c = $('conn');
    const text = { connecting: 'connecting', live: 'live', reconnecting: 'reconnecting…', polling: 'polling every 2 s', ended: 'ended', lost: 'launcher unreachable' }[mode] || mode;
    if (c.textContent !== text) c.textContent = text;
    c.className = 'conn conn-' + mode;
  }
  const jobFinal = () => !!(M.job && FINAL.has(M.job.state));

  function connect() {
    if (typeof EventSource === 'undefined') { startPolling(); return; }
    const es = new EventSource('/events');
    conn.es = es;
    const on = (kind, fn) => es.addEventListener(kind, (e) => {
      conn.fails = 0;
      let d;
      try { d = JSON.parse(e.data); } catch (err) { console.warn('pslaunch: bad', kind, 'event', err); return; }
      fn(d);
    });
    es.onopen = () => { conn.fails = 0; setConn(jobFinal() ? 'ended' : 'live'); };
    on('snapshot', applySnapshot);
    on('lines', (d) => applyLines(d.lines || []));
    on('procs', (d) => applyProcs(d.procs || [], false));
    on('job', applyJob);
    on('points', (d) => applyPoints(d.points || []));
    on('failure', applyFailure);
    es.onerror = () => {
      conn.fails++;
      if (jobFinal() && conn.fails >= 1) { es.close(); setConn('ended'); pollOnce(); return; }
      if (es.readyState === EventSource.CLOSED || conn.fails >= SSE_FAILS) { es.close(); startPolling(); return; }
      setConn('reconnecting');    // the browser retries by itself, sending Last-Event-ID
    };
  }

  async function pollOnce() {
    try {
      const r = await fetch('/api/state', { credentials: 'same-origin', cache: 'no-store' });
      if (!r.ok) throw new Error('HTTP ' + r.status);
      applySnapshot(await r.json());
      return true;
    } catch (err) {
      return false;
    }
  }

  function startPolling() {
    if (conn.poll) return;
    setConn('polling');
    let tries = 0;
    const run = async () => {
      const ok = await pollOnce();
      if (jobFinal()) { clearInterval(conn.poll); conn.poll = 0; setConn('ended'); return; }
      setConn(ok ? 'polling' : 'lost');
      // now and then, try the stream again: it is cheaper and faster than polling
      if (ok && ++tries % 15 === 0) { clearInterval(conn.poll); conn.poll = 0; conn.fails = 0; connect(); }
    };
    conn.poll = setInterval(run, POLL_MS);
    run();
  }

  // ---- wiring ----
  function init() {
    $('bound').textContent = `the log pane shows the newest ${PANE_LINES.toLocaleString('en-US')} lines that pass the filters; the page holds the last ${PROC_LINES.toLocaleString('en-US')} lines of each process`;
    $('procs').tHead.addEventListener('click', onSortClick);
    $('procs').tBodies[0].addEventListener('click', onRowClick);
    $('filter-role').addEventListener('change', () => { selected = null; onFilter(); });
    $('filter-host').addEventListener('change', () => { selected = null; onFilter(); });
    let rt = 0;
    $('filter-rank').addEventListener('input', () => { clearTimeout(rt); rt = setTimeout(onFilter, 150); });
    let st = 0;
    $('search').addEventListener('input', () => { clearTimeout(st); st = setTimeout(onSearchInput, 120); });
    $('search').addEventListener('keydown', (e) => {
      if (e.key === 'Enter') { e.preventDefault(); clearTimeout(st); onSearchInput(); step(e.shiftKey ? -1 : 1); }
      if (e.key === 'Escape') { $('search').value = ''; onSearchInput(); }
    });
    $('search-next').addEventListener('click', () => { onSearchInput(); step(1); });
    $('search-prev').addEventListener('click', () => { onSearchInput(); step(-1); });
    $('search-only').addEventListener('change', (e) => { search.only = e.target.checked; onSearchInput(); dirty.pane = true; schedule(); });
    $('follow').addEventListener('change', (e) => {
      follow = e.target.checked;
      if (follow) pane().scrollTop = pane().scrollHeight;
    });
    pane().addEventListener('scroll', onLogScroll, { passive: true });
    $('failure-show').addEventListener('click', () => { if (M.failure) { selected = null; showProcess(M.failure.name); } });
    document.addEventListener('keydown', (e) => {
      if (e.key === '/' && document.activeElement.tagName !== 'INPUT') { e.preventDefault(); $('search').focus(); }
    });
    window.addEventListener('resize', () => { dirty.chart = true; schedule(); });
    setInterval(tick, 1000);
    drawChart();
    connect();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', init); else init();
})();
