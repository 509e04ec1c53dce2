// The chat page: conversations in the sidebar, the current one in the middle, answers
// streamed from /v1/chat/completions. No framework: the state is plain objects (store.js
// saves them), and the view is rebuilt from them, except the answer being streamed, whose
// element is updated in place. An answer's tool calls are kept as the API gives them
// ({id, type, function: {name, arguments}}), and each result the person gives as a
// {role: "tool", tool_call_id, content} message after that answer.
import { APIError, explain, fetchModel, streamChat } from "./api.js";
import { render } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  sidebar: $("sidebar"), list: $("conversations"), messages: $("messages"), status: $("status"),
  prompt: $("prompt"), composer: $("composer"), send: $("send"), stop: $("stop"),
  modelName: $("model-name"), modelCtx: $("model-ctx"), theme: $("theme"),
  system: $("system"), schema: $("schema"), tools: $("tools"), toolChoice: $("tool-choice"),
  settingsError: $("settings-error"),
  keyDialog: $("key-dialog"), keyForm: $("key-form"), key: $("key"), keyError: $("key-error"),
};
const NUMBERS = { temperature: $("temperature"), top_p: $("top-p"), max_tokens: $("max-tokens"), seed: $("seed") };
const THEMES = ["auto", "light", "dark"];
const needsKey = document.querySelector('meta[name="npllama-auth"]').content === "bearer";

const state = store.loadChats();
const settings = store.loadSettings();
let model = { id: null, ctx: null };
let running = null;        // {controller, conversation, answer}: the answer being streamed
const views = new WeakMap(); // message -> its element

const current = () => state.conversations.find((c) => c.id === state.current);
const conversationOf = (m) => state.conversations.find((c) => c.messages.includes(m));

function save() {
  if (!store.saveChats(state)) setStatus("The browser's storage is full: delete or export some chats.");
}

function setStatus(text) { ui.status.textContent = text; }

// ---- the conversation list ------------------------------------------------------------------
function renderList() {
  ui.list.replaceChildren(...state.conversations.map((c) => {
    const li = document.createElement("li");
    if (c.id === state.current) li.setAttribute("aria-current", "true");
    const open = button(c.title, "open", () => select(c.id));
    open.title = c.title;
    li.append(open,
      button("Rename", "small", () => rename(c), `Rename chat ${c.title}`),
      button("Delete", "small", () => remove(c), `Delete chat ${c.title}`));
    return li;
  }));
}

function button(text, className, onClick, label) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = text;
  if (label) b.setAttribute("aria-label", label);
  b.addEventListener("click", onClick);
  return b;
}

function select(id) {
  state.current = id;
  save();
  renderAll();
  ui.sidebar.classList.remove("open");
  $("toggle-sidebar").setAttribute("aria-expanded", "false");
  ui.prompt.focus();
}

function newChat() {
  const c = store.newConversation();
  state.conversations.unshift(c);
  select(c.id);
}

function rename(c) {
  const title = window.prompt("Rename this chat", c.title);
  if (title && title.trim()) {
    c.title = title.trim();
    save();
    renderList();
  }
}

function remove(c) {
  if (!window.confirm(`Delete the chat "${c.title}"?`)) return;
  if (running && running.conversation === c) running.controller.abort();
  state.conversations = state.conversations.filter((x) => x !== c);
  if (state.current === c.id) state.current = state.conversations[0]?.id ?? null;
  save();
  renderAll();
}

// ---- messages -------------------------------------------------------------------------------
function messageView(m) {
  const el = document.createElement("article");
  el.className = `message ${m.role}`;
  el.setAttribute("aria-label", m.role === "user" ? "You" : "Assistant");
  const body = document.createElement("div");
  body.className = "body";
  const calls = document.createElement("div");
  calls.className = "tool-calls";
  const stats = document.createElement("div");
  stats.className = "stats";
  const error = document.createElement("div");
  error.className = "error";
  error.setAttribute("role", "alert");
  el.append(body, calls, stats, error);
  views.set(m, el);
  updateMessage(m);
  return el;
}

function updateMessage(m) {
  const el = views.get(m);
  if (!el) return;
  const [body, calls, stats, error] = el.children;
  if (m.role === "user") body.textContent = m.content;
  else render(body, m.content);
  body.hidden = !m.content && Boolean(m.tool_calls);
  calls.hidden = !m.tool_calls;
  if (m.tool_calls) calls.replaceChildren(...m.tool_calls.map((call) => callView(m, call)));
  stats.textContent = describeStats(m);
  stats.hidden = !stats.textContent;
  error.textContent = m.error || "";
  error.hidden = !m.error;
}

function describeStats(m) {
  const s = m.stats;
  if (!s) return "";
  const parts = [];
  if (s.tokens != null) parts.push(`${s.tokens} tokens`);
  if (s.tokensPerSecond != null) parts.push(`${s.tokensPerSecond.toFixed(1)} tokens/s`);
  if (s.firstToken != null) parts.push(`first token ${s.firstToken.toFixed(2)} s`);
  if (s.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function renderMessages() {
  const c = current();
  // a tool's result shows under the call it answers, not as a message of its own
  ui.messages.replaceChildren(...(c ? c.messages.filter((m) => m.role !== "tool").map(messageView) : []));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function renderAll() {
  renderList();
  renderMessages();
  ui.system.value = current()?.system ?? "";
}

// ---- tool calls -----------------------------------------------------------------------------
// Each call of an answer: its function's name and arguments (pretty-printed once the answer is
// over and they parse), then the result given for it, or, under the conversation's last answer,
// a form to give it. Names, arguments and results are set as text, never parsed as HTML.
function callView(m, call) {
  const c = conversationOf(m);
  const name = call.function.name;
  const section = document.createElement("section");
  section.className = "tool-call";
  section.setAttribute("aria-label", `Tool call ${name}`);
  const head = document.createElement("div");
  head.className = "tool-name";
  const code = document.createElement("code");
  code.textContent = name;
  head.append("Tool call ", code);
  const args = document.createElement("pre");
  args.className = "tool-args";
  section.append(head, args);
  if (running && running.answer === m) {
    args.textContent = call.function.arguments;
    return section;
  }
  try {
    args.textContent = JSON.stringify(JSON.parse(call.function.arguments), null, 2);
  } catch {
    args.textContent = call.function.arguments;
    section.append(note("The arguments are not complete JSON: the answer was cut short.", "incomplete"));
  }
  const result = c && c.messages.find((x) => x.role === "tool" && x.tool_call_id === call.id);
  if (result) {
    const shown = document.createElement("pre");
    shown.className = "tool-result";
    shown.textContent = result.content;
    section.append(note(`Result of ${name}`, "muted"), shown);
  } else if (c && c.messages.findLast((x) => x.role !== "tool") === m) {
    section.append(resultForm(c, m, call));
  }
  return section;
}

function note(text, className) {
  const p = document.createElement("p");
  p.className = `tool-note ${className}`;
  p.textContent = text;
  return p;
}

function resultForm(c, m, call) {
  const name = call.function.name;
  const form = document.createElement("form");
  form.className = "tool-result-form";
  const input = document.createElement("textarea");
  input.id = `result-${store.newId()}`;
  input.rows = 2;
  input.required = true;
  const label = document.createElement("label");
  label.htmlFor = input.id;
  label.textContent = `Result of ${name}`;
  const submit = document.createElement("button");
  submit.type = "submit";
  submit.textContent = "Send result";
  submit.setAttribute("aria-label", `Send result of ${name}`);
  form.append(label, input, submit);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    giveResult(c, m, call, input.value);
  });
  return form;
}

// A tool's result: kept, and once every call of the answer has one, the conversation goes on.
async function giveResult(c, m, call, content) {
  if (running) {
    setStatus("An answer is still being written: wait for it or stop it, then send the result.");
    return;
  }
  if (!settingsOk()) return;
  c.messages.push({ role: "tool", tool_call_id: call.id, content });
  c.updated = Date.now();
  const answered = (x) => c.messages.some((r) => r.role === "tool" && r.tool_call_id === x.id);
  if (!m.tool_calls.every(answered)) {
    save();
    updateMessage(m);
    return;
  }
  const answer = { role: "assistant", content: "", stats: null, error: null };
  c.messages.push(answer);
  save();
  renderAll();
  await stream(c, answer);
}

// Streamed calls come in pieces, each naming its call by `index`: the first with the call's id
// and name, the later ones with more of its arguments.
function addCallDeltas(m, deltas) {
  m.tool_calls ??= [];
  for (const d of deltas) {
    const call = (m.tool_calls[d.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (d.id) call.id = d.id;
    if (d.function && d.function.name) call.function.name += d.function.name;
    if (d.function && d.function.arguments) call.function.arguments += d.function.arguments;
  }
}

// Streaming renders at most once a frame, however many chunks arrive.
let pending = null;
function scheduleUpdate(m) {
  if (pending) return;
  pending = requestAnimationFrame(() => {
    pending = null;
    updateMessage(m);
    const nearBottom = ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 120;
    if (nearBottom) ui.messages.scrollTop = ui.messages.scrollHeight;
  });
}

// ---- sending --------------------------------------------------------------------------------
function requestBody(c) {
  const messages = [];
  if (c.system.trim()) messages.push({ role: "system", content: c.system });
  for (const m of c.messages.slice(0, -1)) {  // the last is the answer being asked for
    if (m.role === "tool") messages.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    else if (m.tool_calls) messages.push({ role: m.role, content: m.content || null, tool_calls: m.tool_calls });
    else if (m.content) messages.push({ role: m.role, content: m.content });
  }
  const body = { model: model.id || "default", messages, stream: true, stream_options: { include_usage: true } };
  for (const [name, input] of Object.entries(NUMBERS)) {
    if (input.value !== "") body[name] = Number(input.value);
  }
  const schema = ui.schema.value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
  }
  const tools = parseTools(ui.tools.value);
  if (tools.length) {
    body.tools = tools;
    body.tool_choice = ui.toolChoice.value;
  }
  return body;
}

/** The Tools box as a list of OpenAI tool objects ([] when empty); throws an Error saying what is wrong. */
function parseTools(text) {
  if (!text.trim()) return [];
  let tools;
  try { tools = JSON.parse(text); } catch (e) { throw new Error(`Tools (JSON) is not valid JSON: ${e.message}`); }
  const shape = '{"type": "function", "function": {"name": "...", "parameters": {...}}}';
  if (!Array.isArray(tools)) throw new Error(`Tools (JSON) must be an array of tools, each ${shape}`);
  tools.forEach((t, i) => {
    const fn = t && t.function;
    if (t?.type !== "function" || !fn || typeof fn.name !== "string" || !fn.name) {
      throw new Error(`Tools (JSON): tool ${i + 1} is not ${shape}`);
    }
  });
  return tools;
}

function checkSettings() {
  const schema = ui.schema.value.trim();
  if (schema) {
    try { JSON.parse(schema); } catch (e) { return `The JSON Schema is not valid JSON: ${e.message}`; }
  }
  let tools;
  try { tools = parseTools(ui.tools.value); } catch (e) { return e.message; }
  if (tools.length && schema) return "Tools and a JSON Schema for the answer cannot be used together: clear one.";
  for (const input of Object.values(NUMBERS)) {
    if (!input.checkValidity()) return `${input.labels[0].textContent}: ${input.validationMessage}`;
  }
  return "";
}

/** Whether the settings can make a request; if not, they open with what is wrong. */
function settingsOk() {
  const problem = checkSettings();
  ui.settingsError.textContent = problem;
  if (problem) $("settings").open = true;
  return !problem;
}

async function send() {
  const text = ui.prompt.value.trim();
  if (!text || running || !settingsOk()) return;
  if (!current()) newChat();
  const c = current();
  if (!c.messages.length && c.title === "New chat") c.title = text.slice(0, 48);
  c.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "", stats: null, error: null };
  c.messages.push(answer);
  c.updated = Date.now();
  ui.prompt.value = "";
  save();
  renderAll();
  await stream(c, answer);
}

async function stream(c, answer) {
  const controller = new AbortController();
  running = { controller, conversation: c, answer };
  setRunning(true);
  setStatus("");
  const start = performance.now();
  let first = null;
  let usage = null;
  try {
    for await (const ev of streamChat(requestBody(c), { key: store.apiKey(), signal: controller.signal })) {
      if (ev.content) {
        first ??= performance.now();
        answer.content += ev.content;
        scheduleUpdate(answer);
      } else if (ev.toolCalls) {
        first ??= performance.now();
        addCallDeltas(answer, ev.toolCalls);
        scheduleUpdate(answer);
      } else if (ev.usage) {
        usage = ev.usage;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      answer.error = explain(e, model.ctx);
      if (e instanceof APIError && e.status === 401) askForKey(answer.error);
    }
  }
  answer.stats = timing(start, first, performance.now(), usage, controller.signal.aborted);
  running = null;
  setRunning(false);
  c.updated = Date.now();
  save();
  updateMessage(answer);
}

// Time to first token from the request; tokens/s over the decode, after the first token.
function timing(start, first, end, usage, stopped) {
  const stats = { stopped, tokens: usage ? usage.completion_tokens : null, firstToken: null, tokensPerSecond: null };
  if (first != null) stats.firstToken = (first - start) / 1000;
  if (usage && first != null && usage.completion_tokens > 1 && end > first) {
    stats.tokensPerSecond = (usage.completion_tokens - 1) / ((end - first) / 1000);
  }
  return stats;
}

function setRunning(on) {
  ui.messages.setAttribute("aria-busy", String(on));  // screen readers read the answer once it is whole
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  if (!on) ui.prompt.focus();
}

// ---- the model and the API key --------------------------------------------------------------
async function connect() {
  try {
    model = await fetchModel(store.apiKey());
    ui.modelName.textContent = model.id;
    ui.modelCtx.textContent = model.ctx ? `${model.ctx} tokens of context` : "";
    setStatus("");
    return true;
  } catch (e) {
    ui.modelName.textContent = "not connected";
    if (e instanceof APIError && e.status === 401) askForKey(store.apiKey() ? explain(e) : "");
    else setStatus(explain(e));
    return false;
  }
}

function askForKey(message) {
  store.setApiKey(null);
  ui.keyError.textContent = message;
  ui.key.value = "";
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.key.focus();
}

ui.keyForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  store.setApiKey(ui.key.value.trim());
  if (await connect()) ui.keyDialog.close();
});
ui.keyDialog.addEventListener("cancel", (event) => event.preventDefault());  // no key, no chat

// ---- settings, theme, import and export -----------------------------------------------------
for (const [name, input] of Object.entries(NUMBERS)) {
  input.value = settings[name] ?? "";
  input.addEventListener("change", () => { settings[name] = input.value; store.saveSettings(settings); });
}
ui.schema.value = settings.schema ?? "";
ui.schema.addEventListener("change", () => { settings.schema = ui.schema.value; store.saveSettings(settings); });
ui.tools.value = settings.tools ?? "";
ui.tools.addEventListener("change", () => {
  settings.tools = ui.tools.value;
  store.saveSettings(settings);
  ui.settingsError.textContent = checkSettings();
});
ui.toolChoice.value = settings.toolChoice ?? "auto";
ui.toolChoice.addEventListener("change", () => { settings.toolChoice = ui.toolChoice.value; store.saveSettings(settings); });
ui.system.addEventListener("input", () => {
  let c = current();
  if (!c) {  // a system prompt typed before the first message starts a chat
    c = store.newConversation();
    state.conversations.unshift(c);
    state.current = c.id;
    renderList();
  }
  c.system = ui.system.value;
  save();
});

function applyTheme() {
  const theme = THEMES.includes(settings.theme) ? settings.theme : "auto";
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  ui.theme.textContent = `Theme: ${theme}`;
}
ui.theme.addEventListener("click", () => {
  settings.theme = THEMES[(THEMES.indexOf(settings.theme ?? "auto") + 1) % THEMES.length];
  store.saveSettings(settings);
  applyTheme();
});

$("export").addEventListener("click", () => {
  const url = URL.createObjectURL(new Blob([store.exportChats(state)], { type: "application/json" }));
  const a = document.createElement("a");
  a.href = url;
  a.download = "npllama-chats.json";
  a.click();
  setTimeout(() => URL.revokeObjectURL(url), 0);
});

$("import").addEventListener("change", async (event) => {
  const file = event.target.files[0];
  event.target.value = "";
  if (!file) return;
  try {
    const imported = store.parseExport(await file.text());
    state.conversations.unshift(...imported);
    if (imported.length) state.current = imported[0].id;
    save();
    renderAll();
    setStatus(`Imported ${imported.length} chat${imported.length === 1 ? "" : "s"}.`);
  } catch (e) {
    setStatus(`Import failed: ${e.message}`);
  }
});

// ---- the composer and the layout ------------------------------------------------------------
ui.composer.addEventListener("submit", (event) => { event.preventDefault(); send(); });
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => running?.controller.abort());
$("new-chat").addEventListener("click", newChat);
$("toggle-sidebar").addEventListener("click", () => {
  const open = ui.sidebar.classList.toggle("open");
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
});

applyTheme();
if (!state.conversations.some((c) => c.id === state.current)) state.current = state.conversations[0]?.id ?? null;
renderAll();
if (needsKey && !store.apiKey()) askForKey("");
else connect();
ui.prompt.focus();
