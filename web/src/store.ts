// Conversations and settings, kept in the browser's local storage (nothing about them reaches the
// server but the requests themselves), and the JSON export of every conversation.

export interface ToolCall {
  name: string;
  arguments: string;
}

export interface Figures {
  ttftMs: number | null; // request sent -> first token arrived, as this page saw it
  tokensPerSecond: number | null; // after the first token
  promptTokens: number | null;
  completionTokens: number | null;
  cachedTokens: number | null; // prompt tokens whose KV came from the server's prefix cache
  finishReason: string | null;
}

export interface Message {
  role: "user" | "assistant";
  content: string;
  reasoning?: string;
  toolCalls?: ToolCall[];
  figures?: Figures;
  model?: string;
  state?: "streaming" | "done" | "stopped" | "error";
}

export interface Conversation {
  id: string;
  title: string;
  mode: "chat" | "raw";
  created: string;
  messages: Message[];
}

export interface Settings {
  model: string;
  mode: "chat" | "raw";
  system: string;
  temperature: string;
  topP: string;
  topK: string;
  maxTokens: string;
  seed: string;
  stop: string;
  constraintKind: "" | "json_schema" | "regex";
  constraint: string;
  tools: string; // a JSON array of OpenAI tool definitions, or empty
  toolChoice: "auto" | "required" | "none";
}

const CONVERSATIONS = "folio.conversations";
const SETTINGS = "folio.settings";

function read<T>(key: string, fallback: T): T {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : (JSON.parse(text) as T);
  } catch {
    return fallback; // storage written by something else: start afresh rather than break the page
  }
}

export function loadConversations(): Conversation[] {
  const stored = read<Conversation[]>(CONVERSATIONS, []);
  return Array.isArray(stored) ? stored : [];
}

export function saveConversations(conversations: Conversation[]): void {
  localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations));
}

export function loadSettings(): Partial<Settings> {
  return read<Partial<Settings>>(SETTINGS, {});
}

export function saveSettings(settings: Settings): void {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

export function newConversation(mode: "chat" | "raw"): Conversation {
  return { id: crypto.randomUUID(), title: "New conversation", mode, created: new Date().toISOString(), messages: [] };
}

/** Offers every conversation as one JSON file to download. */
export function exportConversations(conversations: Conversation[]): void {
  const blob = new Blob([JSON.stringify({ exported: new Date().toISOString(), conversations }, null, 2)], {
    type: "application/json",
  });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `folio-conversations-${new Date().toISOString().slice(0, 19).replace(/:/g, "")}.json`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}
