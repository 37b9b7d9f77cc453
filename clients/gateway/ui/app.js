// slotwise web page: a chat client and a live picture of every slot's KV cells.
// Sections: dom helpers, api, settings, sessions, chat (composer, streaming), kv, start.
import { renderMarkdown } from "/ui/markdown.js";

const $ = (id) => document.getElementById(id);

// Build an element; text goes through textContent so server strings are never parsed as HTML.
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const shortId = (id) => (id && id.length > 6 ? `${id.slice(0, 4)}…` : id || "");

// ───────────────────────────── api ─────────────────────────────

const KEY_STORAGE = "slotwise.key";

class ApiError extends Error {
  constructor(message, { status = 0, code = "", retryAfter = null } = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

function authHeaders(extra = {}) {
  const key = localStorage.getItem(KEY_STORAGE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// Turn a non-2xx response into an ApiError carrying the server's own message.
async function errorFrom(response) {
  let message = `HTTP ${response.status}`;
  let code = "";
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || "";
    }
  } catch {
    /* not JSON: keep the status line */
  }
  const retry = response.headers.get("Retry-After");
  return new ApiError(message, { status: response.status, code, retryAfter: retry });
}

// fetch with the key; throws ApiError (status 0 = network failure, "abort" = aborted).
async function apiFetch(path, { method = "GET", body, signal, headers = {} } = {}) {
  const init = { method, signal, headers: authHeaders(headers) };
  // behind a router (slotwise serve --models-dir): every call to the model picked
  if (state.model) path += `${path.includes("?") ? "&" : "?"}model=${encodeURIComponent(state.model)}`;
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err && err.name === "AbortError") throw new ApiError("aborted", { code: "abort" });
    throw new ApiError("Cannot reach the server", { status: 0 });
  }
  if (!response.ok) {
    const error = await errorFrom(response);
    if (response.status === 401) askForKey();
    throw error;
  }
  return response;
}

async function apiJson(path, options) {
  const response = await apiFetch(path, options);
  return response.json();
}

// The error in words, as the person at the page should read it.
function describeError(err) {
  if (!(err instanceof ApiError)) return String((err && err.message) || err);
  if (err.status === 0) return "Cannot reach the server";
  if (err.code === "context_length_exceeded")
    return `The conversation is too long for the context: ${err.message}`;
  if (err.status === 429) {
    const n = Number.parseInt(err.retryAfter, 10);
    return `The server's queue is full; try again in ${Number.isFinite(n) ? n : "a few"} s`;
  }
  if (err.status === 503) return "The server is loading or draining; try again shortly";
  if (err.status === 401) return "The server needs an API key";
  return err.message;
}

function showError(err) {
  const box = $("error");
  if (!err) {
    box.textContent = "";
    box.hidden = true;
    return;
  }
  // Aborts are the person's own doing; a 401 already shows the key prompt.
  if (err instanceof ApiError && (err.code === "abort" || err.status === 401)) return;
  box.textContent = typeof err === "string" ? err : describeError(err);
  box.hidden = false;
}

function askForKey() {
  const dialog = $("key-dialog");
  if (dialog.open) return;
  $("key-input").value = localStorage.getItem(KEY_STORAGE) || "";
  dialog.showModal();
  $("key-input").focus();
}

function saveKey(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  $("key-dialog").close();
  showError(null);
  if (!state.model && localStorage.getItem(KEY_STORAGE)) pickModel().then(() => state.model && location.reload());
  loadInfo();
  loadSessions();
  restartKvStream();
}

// Read a text/event-stream body, calling onData with each event's data (comments skipped).
async function readSse(response, onData) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) onData(data);
    }
  }
}

// ───────────────────────────── settings ─────────────────────────────

const SETTINGS_STORAGE = "slotwise.settings";
const MODEL_STORAGE = "slotwise.model";
const SETTING_IDS = { policy: "policy", keep: "keep", maxTokens: "max-tokens", system: "system" };

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}") || {};
  } catch {
    /* a broken entry: start from the defaults */
  }
  for (const [name, id] of Object.entries(SETTING_IDS)) {
    if (typeof saved[name] === "string") $(id).value = saved[name];
  }
  if (!$("policy").value) $("policy").value = "auto";
  for (const id of Object.values(SETTING_IDS)) {
    $(id).addEventListener("change", saveSettings);
    $(id).addEventListener("input", saveSettings);
  }
}

function saveSettings() {
  const values = {};
  for (const [name, id] of Object.entries(SETTING_IDS)) values[name] = $(id).value;
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
}

function settings() {
  const keepText = $("keep").value.trim();
  const keep = keepText === "" ? "system" : Math.max(0, Number.parseInt(keepText, 10) || 0);
  const max = Number.parseInt($("max-tokens").value, 10);
  return {
    policy: $("policy").value || "auto",
    keep,
    maxTokens: Number.isFinite(max) && max >= 1 ? max : 256,
    system: $("system").value.trim(),
  };
}

// ───────────────────────────── sessions ─────────────────────────────

// ── sounds ──

// 16 samples of silence (a 16 kHz mono WAV): what a held sound is sent as (wireContent).
const STAND_IN_WAV =
  "UklGRkQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZGF0YSAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==";
const SOUND_FORMATS = {
  "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav",
  "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac",
};
const SOUNDS_STORAGE = "slotwise.sounds";
const MAX_SOUND_IDS = 1000;

// wav, mp3 or flac by the file's type or name; "" for a sound the server does not take.
function soundFormat(file) {
  const byName = /\.(wav|mp3|flac)$/i.exec(file.name || "");
  return SOUND_FORMATS[file.type] || (byName ? byName[1].toLowerCase() : "");
}

function isSoundFile(file) {
  return file.type.startsWith("audio/") || !!soundFormat(file);
}

// The media ids of sounds this browser sent: the KV view names media by id alone, and the chat
// stream's usage says which of a turn's media are sounds (usage.slotwise.media).
function loadSoundIds() {
  try {
    const ids = JSON.parse(localStorage.getItem(SOUNDS_STORAGE) || "[]");
    return new Set(Array.isArray(ids) ? ids.filter((x) => typeof x === "string") : []);
  } catch {
    return new Set();
  }
}

function learnSounds(usage) {
  const media = (usage.slotwise && usage.slotwise.media) || [];
  const fresh = media.filter((m) => m.kind === "audio" && !state.sounds.has(m.id));
  if (!fresh.length) return;
  for (const m of fresh) state.sounds.add(m.id);
  const kept = Array.from(state.sounds).slice(-MAX_SOUND_IDS);
  state.sounds = new Set(kept);
  localStorage.setItem(SOUNDS_STORAGE, JSON.stringify(kept));
  rerenderKv();
}

const isSound = (mediaId) => !!mediaId && state.sounds.has(mediaId);

// The length the browser reads from the file (null when it cannot tell, soon enough).
function soundSeconds(dataUrl) {
  return new Promise((resolve) => {
    const audio = new Audio();
    const done = (value) => {
      clearTimeout(timer);
      resolve(value);
    };
    const timer = setTimeout(() => done(null), 3000);
    audio.preload = "metadata";
    audio.onloadedmetadata = () => done(Number.isFinite(audio.duration) ? audio.duration : null);
    audio.onerror = () => done(null);
    audio.src = dataUrl;
  });
}

// A sound in a message or the composer: its name and length, and a player while its bytes are
// here (a session opened again has only its name).
function soundChip(sound) {
  const length = sound.seconds ? ` · ${sound.seconds.toFixed(1)} s` : "";
  return el("span", { class: "sound", "data-name": sound.name || "", title: sound.name || "sound" },
    el("span", { text: `♪ ${sound.name || "sound"}${length}` }),
    sound.dataUrl ? el("audio", { controls: true, preload: "none", src: sound.dataUrl }) : null);
}

const state = {
  sessions: [],
  // The open session: id, title, and the messages exactly as the page sends them (system
  // first if any), so a KV segment's message_index points into this array.
  current: null, // { id, title, messages: [{ role, text, images, thumbs, sounds, el }] }
  streaming: null, // AbortController of the reply being streamed
  // attachments, in the order picked: [{ kind: "image", dataUrl, thumb, name }] or
  // [{ kind: "audio", dataUrl, data, format, name, seconds }]
  pending: [],
  info: null,
  model: null, // behind a router: the model picked (its sessions, its KV cells)
  sounds: loadSoundIds(), // media ids known to be sounds (the KV view names media by id only)
};

const sessionTitle = (s) => (s.title && s.title.trim()) || "Untitled";

async function loadSessions() {
  try {
    const data = await apiJson("/slotwise/sessions");
    state.sessions = data.sessions || [];
    renderSessions();
    rerenderKv(); // slot heads name sessions by title
  } catch (err) {
    if (err.status !== 401) showError(err);
  }
}

function renderSessions() {
  const list = $("sessions");
  list.replaceChildren(
    ...state.sessions.map((s) => {
      const isCurrent = state.current && state.current.id === s.id;
      const meta = `${plural(s.num_turns || 0, "turn")} · ${s.num_cells || 0} cells` +
        (s.resident ? " · resident" : "");
      return el(
        "li",
        { class: `session${isCurrent ? " current" : ""}`, "data-id": s.id },
        el(
          "button",
          { type: "button", class: "open", title: meta, "aria-current": isCurrent ? "true" : null,
            onclick: () => openSession(s.id) },
          el("span", { class: "title", text: sessionTitle(s) }),
          el("span", { class: "meta", text: meta })
        ),
        el("button", { type: "button", class: "rename", "aria-label": `Rename ${sessionTitle(s)}`,
          title: "Rename", text: "✎", onclick: (e) => startRename(e.currentTarget.closest("li"), s) }),
        el("button", { type: "button", class: "delete", "aria-label": `Delete ${sessionTitle(s)}`,
          title: "Delete", text: "✕", onclick: () => deleteSession(s) })
      );
    })
  );
}

// Inline rename: the title button becomes an input that commits on Enter or blur.
function startRename(li, session) {
  const open = li.querySelector("button.open");
  const input = el("input", { class: "rename-input", type: "text", "aria-label": "New title" });
  input.value = session.title || "";
  let done = false;
  // Enter and Escape give focus back to the rename button; a blur leaves focus where it went.
  const finish = async (commit, refocus) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (commit && title !== (session.title || "")) {
      try {
        await apiJson(`/slotwise/sessions/${encodeURIComponent(session.id)}`, {
          method: "PATCH",
          body: { title },
        });
        if (state.current && state.current.id === session.id) state.current.title = title;
      } catch (err) {
        showError(err);
      }
    }
    await loadSessions();
    const again = document.querySelector(`#sessions li[data-id="${CSS.escape(session.id)}"] button.rename`);
    if (again && refocus) again.focus();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      e.preventDefault();
      finish(true, true);
    } else if (e.key === "Escape") {
      e.preventDefault();
      e.stopPropagation(); // Escape here cancels the rename, it does not stop a reply
      finish(false, true);
    }
  });
  input.addEventListener("blur", () => finish(true, false));
  open.replaceWith(input);
  input.focus();
  input.select();
}

async function deleteSession(session) {
  if (!window.confirm(`Delete “${sessionTitle(session)}”?`)) return;
  try {
    await apiJson(`/slotwise/sessions/${encodeURIComponent(session.id)}`, { method: "DELETE" });
    if (state.current && state.current.id === session.id) {
      if (state.streaming) state.streaming.abort();
      setCurrent(null);
    }
  } catch (err) {
    showError(err);
  }
  await loadSessions();
}

// A new session exists on the server from its first turn on: that turn creates it with the
// turn's own context options, so `keep` can pin the system message's exact cells (a session
// created empty beforehand would keep its default pins instead).
function newSession() {
  if (state.streaming) state.streaming.abort();
  setCurrent({ id: freshId(), title: "", messages: [] });
  showError(null);
  $("input").focus();
}

function freshId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// A turn's note is the page's JSON ({user, thumbs, system}); other clients' turns have "".
function parseNote(note) {
  if (!note || typeof note !== "string") return null;
  try {
    const value = JSON.parse(note);
    return value && typeof value === "object" && typeof value.user === "string" ? value : null;
  } catch {
    return null;
  }
}

async function openSession(id) {
  if (state.streaming) state.streaming.abort();
  try {
    const session = await apiJson(`/slotwise/sessions/${encodeURIComponent(id)}`);
    const messages = [];
    for (const turn of session.turns || []) {
      const note = parseNote(turn.note);
      if (note) {
        if (note.system && messages.length === 0) messages.push({ role: "system", text: note.system });
        const thumbs = Array.isArray(note.thumbs) ? note.thumbs.filter((t) => typeof t === "string") : [];
        const names = Array.isArray(note.sounds) ? note.sounds.filter((t) => typeof t === "string") : [];
        // Older images are sent again as their thumbnails, older sounds as stand-ins: the
        // server keeps the real ones.
        messages.push({ role: "user", text: note.user, images: thumbs, thumbs,
          sounds: names.map((name) => ({ name })) });
      }
      messages.push({ role: "assistant", text: turn.text || "", usage: turn.usage || null });
    }
    setCurrent({ id: session.id, title: session.title || "", messages });
    showError(null);
  } catch (err) {
    showError(err);
  }
}

function setCurrent(session) {
  state.current = session;
  renderMessages();
  renderSessions();
  rerenderKv(); // roles in the KV titles depend on the open session
}

// ───────────────────────────── chat ─────────────────────────────

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  if (!state.current) {
    box.append(el("p", { class: "empty", text: "Start a new session or pick one on the left." }));
    return;
  }
  state.current.messages.forEach((m, index) => box.append(messageElement(m, index)));
  box.scrollTop = box.scrollHeight;
}

function messageElement(message, index) {
  message.index = index;
  let node;
  if (message.role === "system") {
    // Not a ".message": the system prompt is shown apart from the conversation.
    node = el("div", { class: "system-prompt", "data-index": index },
      el("span", { class: "label", text: "System: " }), el("span", { text: message.text }));
  } else {
    const content = el("div", { class: "content" });
    node = el("div", { class: `message ${message.role}`, "data-index": index }, content);
    if (message.role === "user") {
      content.textContent = message.text;
      const thumbs = message.thumbs || [];
      if (thumbs.length) {
        node.append(el("div", { class: "thumbs" },
          ...thumbs.map((src) => el("img", { class: "thumb", src, alt: "attached image" }))));
      }
      const sounds = message.sounds || [];
      if (sounds.length) node.append(el("div", { class: "thumbs sounds" }, ...sounds.map(soundChip)));
    } else {
      content.innerHTML = renderMarkdown(message.text);
      if (message.usage) node.append(usageElement(message.usage));
    }
  }
  // Hovering a message lights up its cells in the open session's slot.
  node.addEventListener("mouseenter", () => message.unsent || highlightSegments(message.index, true));
  node.addEventListener("mouseleave", () => message.unsent || highlightSegments(message.index, false));
  message.el = node;
  return node;
}

// `usage` is the chat stream's (OpenAI names plus "slotwise"); a stored turn may instead carry
// the gateway's shorter names (prompt_cells, reused_cells, generated_tokens), so both are read.
function usageElement(usage) {
  const sw = usage.slotwise || {};
  const prompt = usage.prompt_tokens ?? usage.prompt_cells ?? 0;
  const reused = usage.prompt_tokens_details?.cached_tokens ?? usage.reused_cells ?? 0;
  const decoded = sw.decoded_prompt_cells ?? prompt - reused;
  const generated = usage.completion_tokens ?? usage.generated_tokens ?? 0;
  const shifts = sw.shifts ?? usage.shifts ?? 0;
  const evicted = sw.evicted_cells ?? usage.evicted_cells ?? 0;
  let text = `${prompt} prompt cells (${decoded} decoded), ${generated} generated, ${plural(shifts, "shift")}`;
  if (evicted) text += ` (evicted ${plural(evicted, "cell")})`;
  if (sw.evicted_images) text += `, ${plural(sw.evicted_images, "image")} evicted`;
  if (sw.truncated_cells) text += `, ${plural(sw.truncated_cells, "cell")} truncated`;
  return el("div", {
    class: "usage",
    "data-prompt-cells": prompt,
    "data-generated": generated,
    "data-shifts": shifts,
    "data-evicted-cells": evicted,
    text,
  });
}

function setStreaming(controller) {
  state.streaming = controller;
  $("stop").disabled = !controller;
  $("send").disabled = !!controller;
}

function scrollToEnd() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

// The note stored with the turn, so the page can show the user's side again after a reload.
function makeNote(userMessage, system) {
  const note = { user: userMessage.text, thumbs: userMessage.thumbs };
  if (userMessage.sounds.length) note.sounds = userMessage.sounds.map((s) => s.name);
  if (system) note.system = system;
  let text = JSON.stringify(note);
  if (text.length > 60000) {
    note.thumbs = [];
    text = JSON.stringify(note);
  }
  if (text.length > 60000) {
    note.user = note.user.slice(0, 20000);
    text = JSON.stringify(note);
  }
  return text;
}

// Images of messages the session already holds go as their thumbnails: the server prepares
// only what follows the last reply, so resending full-size pictures would be bytes for nothing.
// A sound the session holds goes as a stand-in (a few samples of silence) for the same reason:
// prep renders only its marker. Images come first, then sounds, then the text: every turn
// sends a message the same way, so the template writes it the same way.
function wireContent(message, held) {
  const images = held ? message.thumbs || message.images : message.images;
  const parts = (images || []).map((url) => ({ type: "image_url", image_url: { url } }));
  for (const sound of message.sounds || []) {
    const real = !held && sound.data;
    const input_audio = real ? { data: sound.data, format: sound.format } : { data: STAND_IN_WAV, format: "wav" };
    parts.push({ type: "input_audio", input_audio });
  }
  if (!parts.length) return message.text;
  parts.push({ type: "text", text: message.text });
  return parts;
}

async function send() {
  if (state.streaming) return;
  const text = $("input").value;
  const attachments = state.pending.slice();
  if (!text.trim() && !attachments.length) return;
  showError(null);
  const opts = settings();

  if (!state.current) newSession();
  const current = state.current;
  const messages = current.messages;
  const firstTurn = !messages.some((m) => m.role === "assistant");
  const box = $("messages");
  if (!messages.length) box.replaceChildren();

  const added = [];
  let system = "";
  if (!messages.length && opts.system) {
    system = opts.system;
    added.push({ role: "system", text: system });
  }
  const pictures = attachments.filter((a) => a.kind !== "audio");
  const userMessage = {
    role: "user",
    text,
    images: pictures.map((a) => a.dataUrl),
    thumbs: pictures.map((a) => a.thumb),
    sounds: attachments.filter((a) => a.kind === "audio"),
  };
  const reply = { role: "assistant", text: "" };
  added.push(userMessage);
  for (const m of added) box.append(messageElement(m, messages.push(m) - 1));
  const replyEl = messageElement(reply, messages.length);
  replyEl.classList.add("streaming");
  box.append(replyEl);
  messages.push(reply);
  scrollToEnd();

  $("input").value = "";
  state.pending = [];
  renderAttachments();

  const controller = new AbortController();
  setStreaming(controller);
  const lastReply = messages.slice(0, -1).map((m) => m.role).lastIndexOf("assistant");
  const body = {
    model: (state.info && state.info.model) || "slotwise",
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: opts.maxTokens,
    messages: messages.slice(0, -1).map((m, i) => ({
      role: m.role,
      content: wireContent(m, i < lastReply),
    })),
    slotwise: {
      session_id: current.id,
      policy: opts.policy,
      keep: opts.keep,
      note: makeNote(userMessage, system),
    },
  };

  const content = replyEl.querySelector(".content");
  let usage = null;
  let failure = null;
  let stopped = false;
  let frame = 0;
  // Re-render at most once per frame: a long reply re-parsed per token would be quadratic.
  const paint = () => {
    frame = 0;
    content.innerHTML = renderMarkdown(reply.text);
    scrollToEnd();
  };
  try {
    const response = await apiFetch("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
    await readSse(response, (data) => {
      if (data === "[DONE]") return;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch {
        return;
      }
      if (chunk.error) {
        failure = new ApiError(chunk.error.message || "The generation failed", {
          status: -1,
          code: chunk.error.code || "",
        });
        return;
      }
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && typeof delta.content === "string" && delta.content) {
        reply.text += delta.content;
        if (!frame) frame = requestAnimationFrame(paint);
      }
      if (chunk.usage) usage = chunk.usage;
    });
  } catch (err) {
    if (err instanceof ApiError && err.code === "abort") stopped = true;
    else if (err && err.name === "AbortError") stopped = true;
    else failure = err instanceof ApiError ? err : new ApiError("Cannot reach the server");
  }
  if (frame) cancelAnimationFrame(frame);
  setStreaming(null);
  replyEl.classList.remove("streaming");
  if (state.current !== current) return; // the person opened another session meanwhile

  if (failure && !reply.text && !usage) {
    // Nothing came back: take the turn out again and give the text back for a retry.
    for (let i = 0; i < added.length + 1; i++) {
      const m = messages.pop();
      if (m && m.el) m.el.remove();
    }
    if (!$("input").value) $("input").value = text;
    state.pending = attachments.concat(state.pending);
    renderAttachments();
    showError(failure);
    return;
  }
  content.innerHTML = renderMarkdown(reply.text);
  if (stopped) content.append(el("p", { class: "stopped", text: "(stopped)" }));
  if (failure) showError(failure);
  if (usage) {
    reply.usage = usage;
    replyEl.append(usageElement(usage));
    learnSounds(usage);
  } else {
    // The session records a turn only when it completes, so a stopped or failed exchange stays
    // on screen but leaves the conversation sent next time (message indices stay the server's).
    messages.splice(messages.indexOf(userMessage), 2);
    for (const m of [userMessage, reply]) {
      m.unsent = true;
      m.el.classList.add("unsent");
    }
  }
  scrollToEnd();

  if (firstTurn && !current.title) {
    const title = text.trim().replace(/\s+/g, " ").slice(0, 40) ||
      (userMessage.sounds.length && !pictures.length ? "Sound" : "Image");
    try {
      await apiJson(`/slotwise/sessions/${encodeURIComponent(current.id)}`, { method: "PATCH", body: { title } });
      current.title = title;
    } catch {
      /* the title is a nicety: the turn itself went through */
    }
  }
  await loadSessions();
}

function stop() {
  if (state.streaming) state.streaming.abort();
}

// ── attachments ──

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// A small JPEG kept in the turn's note (max 96 px side) so the note stays small.
function makeThumb(dataUrl) {
  return new Promise((resolve) => {
    const img = new Image();
    img.onload = () => {
      const scale = Math.min(1, 96 / Math.max(img.naturalWidth || 1, img.naturalHeight || 1));
      const canvas = document.createElement("canvas");
      canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
      canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
      const ctx = canvas.getContext("2d");
      ctx.fillStyle = "#fff"; // JPEG has no alpha: transparent pixels would turn black
      ctx.fillRect(0, 0, canvas.width, canvas.height);
      ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
      resolve(canvas.toDataURL("image/jpeg", 0.7));
    };
    img.onerror = () => resolve(null);
    img.src = dataUrl;
  });
}

async function addFiles(files) {
  for (const file of Array.from(files || [])) {
    if (isSoundFile(file)) {
      await addSound(file);
      continue;
    }
    if (!file.type.startsWith("image/")) continue;
    try {
      const dataUrl = await readAsDataUrl(file);
      const thumb = await makeThumb(dataUrl);
      if (!thumb) {
        showError(`Cannot read the image ${file.name}`);
        continue;
      }
      state.pending.push({ kind: "image", dataUrl, thumb, name: file.name });
    } catch {
      showError(`Cannot read the image ${file.name}`);
    }
  }
  renderAttachments();
}

// A sound goes as an input_audio part: its bytes (base64) and its format.
async function addSound(file) {
  const format = soundFormat(file);
  if (!format) {
    showError(`${file.name}: sounds are taken as WAV, MP3 or FLAC files`);
    return;
  }
  try {
    const dataUrl = await readAsDataUrl(file);
    const data = dataUrl.slice(dataUrl.indexOf(",") + 1);
    const seconds = await soundSeconds(dataUrl);
    state.pending.push({ kind: "audio", dataUrl, data, format, name: file.name, seconds });
  } catch {
    showError(`Cannot read the sound ${file.name}`);
  }
}

function renderAttachments() {
  $("attachments").replaceChildren(
    ...state.pending.map((a, i) =>
      el("div", { class: `attachment${a.kind === "audio" ? " sound-attachment" : ""}` },
        a.kind === "audio" ? soundChip(a) : el("img", { class: "thumb", src: a.thumb, alt: a.name || "image" }),
        el("button", { type: "button", class: "remove", "aria-label": `Remove ${a.name || "image"}`,
          text: "✕", onclick: () => { state.pending.splice(i, 1); renderAttachments(); } }))
    )
  );
}

function wireComposer() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("input").addEventListener("paste", (e) => {
    const files = Array.from(e.clipboardData?.files || []).filter((f) => f.type.startsWith("image/") || isSoundFile(f));
    if (files.length) {
      e.preventDefault();
      addFiles(files);
    }
  });
  $("file").addEventListener("change", (e) => {
    addFiles(e.target.files);
    e.target.value = ""; // the same file can be picked again
  });
  $("stop").addEventListener("click", stop);
  const chat = $("chat");
  chat.addEventListener("dragover", (e) => {
    if (Array.from(e.dataTransfer?.types || []).includes("Files")) {
      e.preventDefault();
      chat.classList.add("dropping");
    }
  });
  chat.addEventListener("dragleave", (e) => {
    if (!chat.contains(e.relatedTarget)) chat.classList.remove("dropping");
  });
  chat.addEventListener("drop", (e) => {
    e.preventDefault();
    chat.classList.remove("dropping");
    addFiles(e.dataTransfer?.files);
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.streaming && !$("key-dialog").open) {
      e.preventDefault();
      stop();
    }
  });
}

// ───────────────────────────── kv ─────────────────────────────

let kvView = null;
const slotCache = new Map(); // slot number -> JSON of the last drawn slot (redraw on change only)

// Resolves false when the server wants a key (the key prompt is then open).
async function loadInfo() {
  try {
    state.info = await apiJson("/slotwise/info");
    renderKvInfo();
  } catch (err) {
    if (err.status === 401) return false;
    $("kv-info").textContent = describeError(err);
  }
  return true;
}

function renderKvInfo() {
  const info = state.info || {};
  const slots = info.num_slots ?? (kvView ? kvView.slots.length : null);
  const cells = info.num_cells_per_slot ?? (kvView ? kvView.num_cells_per_slot : null);
  const mrope = info.uses_mrope ?? (kvView ? kvView.uses_mrope : false);
  if (slots === null || cells === null) return;
  const parts = [`${plural(slots, "slot")} × ${cells} cells`, mrope ? "M-RoPE" : "1-D positions"];
  if (info.can_shift === false) parts.push("no context shift");
  if (info.cache_type_k) {
    // what a cell is made of: its K and V types, and the bytes one takes
    parts.push(`cells of K ${info.cache_type_k} / V ${info.cache_type_v}, ${info.bytes_per_cell} B each`);
  }
  if (info.model) parts.push(`model ${info.model}`);
  $("kv-info").textContent = parts.join(", ");
}

function rerenderKv() {
  slotCache.clear();
  if (kvView) renderKv(kvView);
}

function openSessionMessages(slot) {
  return state.current && slot.session_id && slot.session_id === state.current.id ? state.current.messages : null;
}

function messageLabel(index, messages) {
  if (index === undefined || index === null || index < 0) return "";
  const role = messages && messages[index] ? ` (${messages[index].role})` : "";
  return `message ${index}${role}`;
}

function segmentTitle(seg, messages) {
  const parts = [];
  const label = messageLabel(seg.message_index, messages);
  if (label) parts.push(label);
  if (seg.pinned) parts.push("pinned");
  const end = seg.pos_start + seg.num_positions;
  if (seg.kind === "media") {
    parts.push(`${mediaWord(seg)} ${shortId(seg.media_id)}`, plural(seg.num_cells, "cell"),
      `${plural(seg.num_positions, "position")} (${seg.pos_start}–${end})`);
  } else {
    parts.push(seg.kind, plural(seg.num_cells, "cell"), `positions ${seg.pos_start}–${end}`);
    if (seg.preview) parts.push(`“${seg.preview}…”`);
  }
  return parts.join(" · ");
}

const mediaWord = (seg) => (isSound(seg.media_id) ? "sound" : "image");

// A segment's colour: pinned, a sound's cells (media the page knows as sounds), or its kind.
const segKind = (seg) => (seg.pinned ? "pinned" : seg.kind === "media" && isSound(seg.media_id) ? "audio" : seg.kind);

function unitText(unit) {
  if (unit.kind === "media") return `${mediaWord(unit)} ${shortId(unit.media_id)} ${plural(unit.num_cells, "cell")}`;
  const where = unit.message_index >= 0 ? `message ${unit.message_index} ` : "";
  return `${where}${unit.kind} ${plural(unit.num_cells, "cell")}`;
}

function shiftText(shift) {
  const units = (shift.evicted || []).map(unitText).join(", ");
  return `shift (${shift.policy}) at cell ${shift.at_cell}: evicted ${plural(shift.num_cells_evicted, "cell")}` +
    ` / ${plural(shift.num_positions_evicted, "position")}${units ? ` — ${units}` : ""}`;
}

function slotOwner(slot) {
  if (slot.visible === false) return "another tenant";
  if (slot.session_id) {
    const known = state.sessions.find((s) => s.id === slot.session_id);
    const open = state.current && state.current.id === slot.session_id ? ", open" : "";
    const title = known && known.title ? ` (“${known.title}”${open})` : open ? " (open)" : "";
    return `${slot.session_id}${title}`;
  }
  if (slot.state === "free" || !slot.num_cells) return "free";
  return "stateless";
}

function kib(bytes) {
  return bytes >= 1 << 20 ? `${(bytes / (1 << 20)).toFixed(1)} MiB` : `${(bytes / 1024).toFixed(1)} KiB`;
}

function drawSlot(slot, capacity) {
  const messages = openSessionMessages(slot);
  const used = slot.num_cells || 0;
  const free = Math.max(0, capacity - used);
  // The " · " separators are text so the head also reads well as plain text (copy, screen readers).
  const sep = () => el("span", { class: "sep", "aria-hidden": "true", text: " · " });
  const head = el("div", { class: "slot-head" },
    el("span", { class: "slot-name", text: `slot ${slot.slot}` }), sep(),
    el("span", { class: "owner", title: slot.session_id || "", text: slotOwner(slot) }), sep(),
    el("span", { class: `state state-${slot.state}`, text: slot.state }), sep(),
    el("span", { class: "cells", "data-used": used, "data-capacity": capacity,
      "data-next-position": slot.next_position ?? 0,
      text: `${used} / ${capacity} cells · next position ${slot.next_position ?? 0}` }));

  const bar = el("div", { class: "bar", role: "img",
    "aria-label": `slot ${slot.slot}: ${used} of ${capacity} cells used` });
  const posBar = el("div", { class: "pos-bar", "aria-hidden": "true" });
  // Positions can pass the capacity (gaps, 1-D counting after shifts): scale to whichever is larger.
  let posScale = Math.max(capacity, slot.next_position || 0);
  for (const seg of slot.segments || []) posScale = Math.max(posScale, seg.pos_start + seg.num_positions);

  if (slot.shared_prefix != null && slot.num_shared_cells) {
    // Cells of a shared prefix: stored once, drawn once above; here a box that stands for them.
    bar.append(el("div", { class: "seg", "data-kind": "shared", "data-type": "shared",
      "data-cells": slot.num_shared_cells, "data-shared-prefix": slot.shared_prefix,
      title: `shared prefix #${slot.shared_prefix} · ${plural(slot.num_shared_cells, "cell")}, stored once`,
      style: { flexGrow: String(slot.num_shared_cells) } }));
    const end = (slot.segments || []).length ? slot.segments[0].pos_start : slot.next_position || 0;
    posBar.append(el("div", { class: "pos-seg", "data-kind": "shared",
      title: `shared prefix #${slot.shared_prefix}: positions 0–${end}`,
      style: { left: "0%", width: `${(100 * end) / posScale}%` } }));
  }
  if (slot.visible === false) {
    bar.append(el("div", { class: "seg", "data-kind": "other", "data-type": "other", "data-cells": used,
      title: `another tenant · ${plural(used, "cell")}`, style: { flexGrow: String(used) } }));
  }
  for (const seg of slot.segments || []) {
    const kind = segKind(seg);
    const title = segmentTitle(seg, messages);
    const node = el("div", {
      class: "seg", "data-kind": kind, "data-type": seg.kind, "data-cells": seg.num_cells,
      "data-message-index": seg.message_index, "data-media-id": seg.media_id || null, title,
      tabindex: messages ? "0" : null,
      style: { flexGrow: String(seg.num_cells) },
    });
    if (messages) {
      // Hovering or focusing a segment of the open session lights up its message in the chat.
      const on = () => highlightMessage(seg.message_index, true);
      const off = () => highlightMessage(seg.message_index, false);
      node.addEventListener("mouseenter", on);
      node.addEventListener("mouseleave", off);
      node.addEventListener("focus", on);
      node.addEventListener("blur", off);
    }
    bar.append(node);
    posBar.append(el("div", { class: "pos-seg", "data-kind": kind, title, style: {
      left: `${(100 * seg.pos_start) / posScale}%`, width: `${(100 * seg.num_positions) / posScale}%` } }));
  }
  bar.append(el("div", { class: "seg", "data-kind": "free", "data-type": "free", "data-cells": free,
    title: `free · ${plural(free, "cell")}`, style: { flexGrow: String(free) } }));
  for (const shift of slot.shifts || []) {
    bar.append(el("div", { class: "shift-mark", "data-shift-id": shift.id,
      "data-evicted-cells": shift.num_cells_evicted, "data-at-cell": shift.at_cell,
      title: shiftText(shift),
      style: { left: `${Math.min(100, (100 * shift.at_cell) / capacity)}%` } }));
  }
  const children = [head, bar, posBar];
  if (slot.num_recurrent_bytes) {
    // Hybrid memory: a state of fixed size beside the cells, whatever the sequence's length.
    const checkpoints = slot.num_checkpoints
      ? `${plural(slot.num_checkpoints, "checkpoint")} kept (${kib(slot.num_checkpoint_bytes)})`
      : "no checkpoint kept";
    children.push(el("div", { class: "recurrent", "data-bytes": slot.num_recurrent_bytes,
      "data-checkpoints": slot.num_checkpoints || 0,
      text: `recurrent state · ${kib(slot.num_recurrent_bytes)} · ${checkpoints}`,
      title: "the recurrent layers' state of this sequence: it cannot be cut back, only " +
        "restored from a checkpoint (then what followed is decoded again)" }));
  }
  if ((slot.shifts || []).length) {
    children.push(el("ul", { class: "shifts" }, ...slot.shifts.map((shift) =>
      el("li", { "data-shift-id": shift.id, "data-evicted-cells": shift.num_cells_evicted, text: shiftText(shift) }))));
  }
  const isOpen = !!messages;
  return el("div", { class: `slot${isOpen ? " open-session" : ""}`, "data-slot": slot.slot }, ...children);
}

// A shared prefix (--kv-unified): its cells once, with the slots whose sequences open with it.
function drawSharedPrefix(prefix, capacity) {
  const sharers = prefix.slots.length ? `shared by ${prefix.slots.map((s) => `slot ${s}`).join(", ")}` : "kept, unused";
  const head = el("div", { class: "slot-head" },
    el("span", { class: "slot-name", text: `shared prefix #${prefix.holder}` }),
    el("span", { class: "sep", "aria-hidden": "true", text: " · " }),
    el("span", { class: "owner", text: sharers }),
    el("span", { class: "cells", text: `${prefix.num_cells} cells, stored once` }));
  const bar = el("div", { class: "bar", role: "img",
    "aria-label": `shared prefix #${prefix.holder}: ${prefix.num_cells} cells` });
  for (const seg of prefix.segments) {
    bar.append(el("div", { class: "seg", "data-kind": segKind(seg), "data-type": seg.kind,
      "data-cells": seg.num_cells, title: segmentTitle(seg, null), style: { flexGrow: String(seg.num_cells) } }));
  }
  bar.append(el("div", { class: "seg", "data-kind": "free", "data-type": "free",
    style: { flexGrow: String(Math.max(0, capacity - prefix.num_cells)) } }));
  return el("div", { class: "slot shared-prefix", "data-holder": prefix.holder }, head, bar);
}

function renderKv(view) {
  kvView = view;
  if (!state.info) renderKvInfo();
  const capacity = view.num_cells_per_slot || (state.info && state.info.num_cells_per_slot) || 1;
  const shared = $("shared-prefixes");
  const key = JSON.stringify([view.shared_prefixes || [], capacity]);
  if (shared.dataset.drawn !== key) {
    shared.dataset.drawn = key;
    shared.replaceChildren(...(view.shared_prefixes || []).map((p) => drawSharedPrefix(p, capacity)));
  }
  const box = $("slots");
  const seen = new Set();
  for (const slot of view.slots || []) {
    seen.add(String(slot.slot));
    const key = JSON.stringify([slot, capacity]);
    let node = box.querySelector(`.slot[data-slot="${slot.slot}"]`);
    if (node && slotCache.get(slot.slot) === key) continue; // unchanged: keep focus and hover
    slotCache.set(slot.slot, key);
    const fresh = drawSlot(slot, capacity);
    if (node) node.replaceWith(fresh);
    else box.append(fresh);
  }
  for (const node of Array.from(box.children)) {
    if (!seen.has(node.dataset.slot)) {
      slotCache.delete(Number(node.dataset.slot));
      node.remove();
    }
  }
}

function highlightMessage(index, on) {
  const m = state.current && state.current.messages[index];
  if (m && m.el) m.el.classList.toggle("kv-highlight", on);
}

function highlightSegments(index, on) {
  for (const node of document.querySelectorAll(`#slots .slot.open-session .seg[data-message-index="${index}"]`))
    node.classList.toggle("highlight", on);
}

// The KV stream: fetch + a body reader (EventSource cannot send the Authorization header).
const kv = { controller: null, retryMs: 1000, timer: 0, waitingForKey: false };

function startKvStream() {
  if (kv.controller || document.hidden || kv.waitingForKey) return;
  clearTimeout(kv.timer);
  const controller = new AbortController();
  kv.controller = controller;
  (async () => {
    try {
      const response = await apiFetch("/slotwise/kv?interval_ms=250", {
        signal: controller.signal,
        headers: { Accept: "text/event-stream" },
      });
      await readSse(response, (data) => {
        let view;
        try {
          view = JSON.parse(data);
        } catch {
          return; // a malformed event: wait for the next one
        }
        if (view && view.error) {
          // the watch failed after it began (e.g. the server drains): say so, keep the backoff
          $("kv-info").textContent = `KV stream: ${view.error.message || "ended"}; reconnecting…`;
          return;
        }
        renderKv(view);
        kv.retryMs = 1000; // a working stream resets the backoff
      });
    } catch (err) {
      if (controller.signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) kv.waitingForKey = true;
      else $("kv-info").textContent = `KV stream: ${describeError(err)}; reconnecting…`;
    } finally {
      if (kv.controller === controller) kv.controller = null;
    }
    if (controller.signal.aborted || kv.waitingForKey) return;
    // Ended or failed: reconnect with a growing delay so a down server is not hammered.
    kv.timer = setTimeout(startKvStream, kv.retryMs);
    kv.retryMs = Math.min(kv.retryMs * 2, 30000);
  })();
}

function stopKvStream() {
  clearTimeout(kv.timer);
  if (kv.controller) kv.controller.abort();
  kv.controller = null;
}

function restartKvStream() {
  stopKvStream();
  kv.waitingForKey = false;
  kv.retryMs = 1000;
  startKvStream();
}

// ───────────────────────────── start ─────────────────────────────

function wireLayout() {
  const button = $("toggle-sidebar");
  button.addEventListener("click", () => {
    const hidden = document.body.classList.toggle("sidebar-hidden");
    $("sidebar").hidden = hidden;
    button.setAttribute("aria-expanded", String(!hidden));
  });
  $("new-session").addEventListener("click", newSession);
  $("key-form").addEventListener("submit", saveKey);
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) stopKvStream();
    else restartKvStream();
  });
}

// Behind a router (its /props says role "router"): a picker of its models; the page then talks
// to the one picked, and picking another starts the page again on that one.
async function pickModel() {
  let models;
  try {
    const props = await (await fetch("/props", { headers: authHeaders({}) })).json();
    if (!props || props.role !== "router") return;
    models = (await apiJson("/models")).data || [];
  } catch (err) {
    return; // (a key is asked for by what follows; the picker comes with the next load)
  }
  if (!models.length) return;
  const picker = $("model-picker");
  picker.replaceChildren(...models.map((m) => el("option", { value: m.id, text: `${m.id} (${m.status.value})` })));
  const saved = localStorage.getItem(MODEL_STORAGE);
  state.model = models.some((m) => m.id === saved) ? saved : models[0].id;
  picker.value = state.model;
  picker.hidden = false;
  picker.addEventListener("change", () => {
    localStorage.setItem(MODEL_STORAGE, picker.value);
    location.reload();
  });
}

async function start() {
  loadSettings();
  wireLayout();
  wireComposer();
  renderMessages();
  await pickModel();
  // Ask /info first: if it wants a key, the rest waits for saveKey instead of failing too.
  if (!(await loadInfo())) {
    kv.waitingForKey = true;
    return;
  }
  loadSessions();
  startKvStream();
}

start();
