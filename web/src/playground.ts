// The playground at `/`: a chat (or raw completion) with any model the server offers, streamed as it
// arrives, with a stop button that closes the request (the server counts it aborted), sampling and
// structured-output settings, and conversations kept in this browser.

import "./style.css";
import "./playground.css";
import { APIError, type ModelCard, listModels } from "./api";
import { SettingsError, streamAnswer } from "./answer";
import { logOutButton, withLogin } from "./login";
import { renderMessage } from "./message_view";
import {
  type Conversation,
  type Message,
  type Settings,
  exportConversations,
  loadConversations,
  loadSettings,
  newConversation,
  saveConversations,
  saveSettings,
} from "./store";

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;

const FIELDS: [keyof Settings, string][] = [
  ["model", "model"],
  ["mode", "mode"],
  ["system", "system"],
  ["temperature", "temperature"],
  ["topP", "top-p"],
  ["topK", "top-k"],
  ["maxTokens", "max-tokens"],
  ["seed", "seed"],
  ["stop", "stop-sequences"],
  ["constraintKind", "constraint-kind"],
  ["constraint", "constraint"],
  ["tools", "tools"],
  ["toolChoice", "tool-choice"],
];

type Field = HTMLInputElement | HTMLSelectElement | HTMLTextAreaElement;

let conversations = loadConversations();
let current: Conversation;
let running: AbortController | null = null;

function settings(): Settings {
  return Object.fromEntries(FIELDS.map(([key, id]) => [key, $<Field>(id).value])) as unknown as Settings;
}

function restoreSettings(): void {
  const saved = loadSettings();
  for (const [key, id] of FIELDS) {
    const value = saved[key];
    if (typeof value === "string" && key !== "model") $<Field>(id).value = value;
  }
  $("constraint").hidden = $<HTMLSelectElement>("constraint-kind").value === "";
}

function showError(message: string | null): void {
  const box = $("error");
  box.textContent = message ?? "";
  box.hidden = message === null;
}

function fillModels(models: ModelCard[]): void {
  const picker = $<HTMLSelectElement>("model");
  const wanted = loadSettings().model;
  picker.replaceChildren(
    ...models.map((card) => {
      const label = card.parent ? `${card.id} (adapter of ${card.parent})` : card.id;
      return new Option(label, card.id);
    }),
  );
  if (wanted && models.some((card) => card.id === wanted)) picker.value = wanted;
}

function persist(): void {
  saveConversations(conversations);
  renderConversationList();
}

function renderConversationList(): void {
  const list = $("conversations");
  list.replaceChildren(
    ...conversations.map((conversation) => {
      const item = document.createElement("li");
      item.classList.toggle("current", conversation.id === current.id);
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = conversation.title;
      open.onclick = () => switchTo(conversation);
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Delete ${conversation.title}`);
      remove.onclick = () => deleteConversation(conversation);
      item.append(open, remove);
      return item;
    }),
  );
}

function renderMessages(): void {
  const list = $("messages");
  list.replaceChildren(...current.messages.map((message, index) => messageItem(message, index)));
  list.scrollTop = list.scrollHeight;
}

function messageItem(message: Message, index: number): HTMLLIElement {
  const item = document.createElement("li");
  const last = index === current.messages.length - 1;
  renderMessage(item, message, current.mode === "raw", {
    copy: () => copy(message.content),
    ...(last && message.role === "assistant" ? { regenerate: () => regenerate() } : {}),
  });
  return item;
}

async function copy(text: string): Promise<void> {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    showError("the browser did not allow copying to the clipboard");
  }
}

function switchTo(conversation: Conversation): void {
  if (running) return;
  current = conversation;
  $<HTMLSelectElement>("mode").value = current.mode;
  renderMessages();
  renderConversationList();
}

function deleteConversation(conversation: Conversation): void {
  if (running && conversation.id === current.id) return;
  conversations = conversations.filter((c) => c.id !== conversation.id);
  if (conversation.id === current.id) current = conversations[0] ?? startConversation();
  persist();
  renderMessages();
}

function startConversation(): Conversation {
  const conversation = newConversation($<HTMLSelectElement>("mode").value as "chat" | "raw");
  conversations.unshift(conversation);
  return conversation;
}

function setBusy(busy: boolean): void {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function answer(): Promise<void> {
  const chosen = settings();
  saveSettings(chosen);
  const reply: Message = { role: "assistant", content: "", model: chosen.model, state: "streaming" };
  current.messages.push(reply);
  const list = $("messages");
  const item = messageItem(reply, current.messages.length - 1);
  list.append(item);
  running = new AbortController();
  setBusy(true);
  showError(null);
  let frame = 0;
  const redraw = () => {
    frame = 0;
    const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
    renderMessage(item, reply, current.mode === "raw", {});
    if (nearBottom) list.scrollTop = list.scrollHeight;
  };
  try {
    await streamAnswer(current, chosen, reply, running.signal, () => {
      frame ||= requestAnimationFrame(redraw);
    });
    reply.state = "done";
  } catch (error) {
    if (running.signal.aborted) {
      reply.state = "stopped";
      if (reply.figures) reply.figures.finishReason = "stopped";
    } else {
      reply.state = "error";
      showError(error instanceof SettingsError || error instanceof APIError ? error.message : String(error));
      if (reply.content === "") current.messages.pop(); // nothing came back: leave no empty answer behind
    }
  } finally {
    cancelAnimationFrame(frame);
    running = null;
    setBusy(false);
    persist();
    renderMessages();
  }
}

async function send(): Promise<void> {
  const prompt = $<HTMLTextAreaElement>("prompt");
  const text = prompt.value;
  if (running || text.trim() === "") return;
  if (current.mode !== $<HTMLSelectElement>("mode").value && current.messages.length > 0) current = startConversation();
  current.mode = $<HTMLSelectElement>("mode").value as "chat" | "raw";
  if (current.messages.length === 0) current.title = text.trim().slice(0, 60);
  current.messages.push({ role: "user", content: text });
  prompt.value = "";
  renderMessages();
  await answer();
}

async function regenerate(): Promise<void> {
  if (running || current.messages.at(-1)?.role !== "assistant") return;
  current.messages.pop();
  renderMessages();
  await answer();
}

function wire(): void {
  $<HTMLFormElement>("composer").onsubmit = (event) => {
    event.preventDefault();
    void send();
  };
  $("prompt").onkeydown = (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      void send();
    }
  };
  $("stop").onclick = () => running?.abort();
  $("new-chat").onclick = () => {
    if (running) return;
    current = startConversation();
    persist();
    renderMessages();
  };
  $("export").onclick = () => exportConversations(conversations);
  $("constraint-kind").onchange = () => {
    $("constraint").hidden = $<HTMLSelectElement>("constraint-kind").value === "";
  };
  $("mode").onchange = () => {
    if (!running && current.messages.length === 0) current.mode = $<HTMLSelectElement>("mode").value as "chat" | "raw";
  };
  const toggle = $("settings-toggle");
  toggle.onclick = () => {
    const open = $("side").classList.toggle("open");
    toggle.setAttribute("aria-expanded", String(open));
  };
  for (const [, id] of FIELDS) $(id).addEventListener("change", () => saveSettings(settings()));
}

async function main(): Promise<void> {
  restoreSettings();
  wire();
  current = conversations[0] ?? startConversation();
  $<HTMLSelectElement>("mode").value = current.mode;
  renderConversationList();
  renderMessages();
  try {
    fillModels(await withLogin(listModels));
  } catch (error) {
    showError(`could not list the server's models: ${(error as Error).message}`);
  }
  logOutButton($<HTMLButtonElement>("logout"));
}

void main();
