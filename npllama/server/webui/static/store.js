// What the page keeps in the browser: conversations and settings in localStorage, the API key
// in sessionStorage (this tab only, gone when it closes).

const CHATS = "npllama.chats.v1";
const SETTINGS = "npllama.settings.v1";
const KEY = "npllama.apiKey";
const FORMAT = "npllama-chats";

// Not crypto.randomUUID: that needs a secure context, and the page may be served over plain
// http to another machine on the network.
export const newId = () => Array.from(crypto.getRandomValues(new Uint8Array(12)),
  (b) => b.toString(16).padStart(2, "0")).join("");

export function newConversation() {
  const now = Date.now();
  return { id: newId(), title: "New chat", system: "", messages: [], created: now, updated: now };
}

function read(storage, name, fallback) {
  try {
    const value = JSON.parse(storage.getItem(name));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

/** {conversations: [...], current: id | null}, newest first. */
export function loadChats() {
  const state = read(localStorage, CHATS, null);
  if (!state || !Array.isArray(state.conversations)) return { conversations: [], current: null };
  return state;
}

/** Save the conversations; false if the browser's storage is full. */
export function saveChats(state) {
  try {
    localStorage.setItem(CHATS, JSON.stringify(state));
    return true;
  } catch {
    return false;
  }
}

export const loadSettings = () => read(localStorage, SETTINGS, {});
export const saveSettings = (settings) => localStorage.setItem(SETTINGS, JSON.stringify(settings));

export const apiKey = () => sessionStorage.getItem(KEY);
export const setApiKey = (key) => (key ? sessionStorage.setItem(KEY, key) : sessionStorage.removeItem(KEY));

export function exportChats(state) {
  return JSON.stringify({ format: FORMAT, version: 1, conversations: state.conversations }, null, 2);
}

const isCall = (c) => c && typeof c.id === "string" && c.function && typeof c.function.name === "string" &&
  typeof c.function.arguments === "string";

function checkMessage(m, where) {
  if (!m || !["system", "user", "assistant", "tool"].includes(m.role) || typeof m.content !== "string") {
    throw new Error(`${where}: each message needs a role (system, user, assistant, tool) and a string content`);
  }
  if (m.tool_calls !== undefined && !(m.role === "assistant" && Array.isArray(m.tool_calls) && m.tool_calls.every(isCall))) {
    throw new Error(`${where}: tool_calls must be an assistant's list of {"id", "function": {"name", "arguments"}}`);
  }
  if (m.role === "tool" && typeof m.tool_call_id !== "string") {
    throw new Error(`${where}: a tool message needs the tool_call_id of the call it answers`);
  }
}

/** Conversations read from an export (given new ids); throws an Error naming what is wrong. */
export function parseExport(text) {
  let data;
  try { data = JSON.parse(text); } catch { throw new Error("the file is not JSON"); }
  if (!data || data.format !== FORMAT || !Array.isArray(data.conversations)) {
    throw new Error(`the file is not an export of this page (its "format" should be "${FORMAT}")`);
  }
  return data.conversations.map((c, i) => {
    if (!c || !Array.isArray(c.messages)) throw new Error(`conversation ${i + 1} has no messages list`);
    c.messages.forEach((m, j) => checkMessage(m, `conversation ${i + 1}, message ${j + 1}`));
    const now = Date.now();
    return { ...c, id: newId(), title: String(c.title || "Imported chat"), system: String(c.system || ""),
             created: c.created || now, updated: c.updated || now };
  });
}
