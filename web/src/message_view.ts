// A message as the page shows it: Markdown (rendered safely) for chat answers, plain text for prompts
// and raw completions, reasoning folded away, tool calls as cards, and the answer's figures.

import { renderMarkdown } from "./markdown";
import type { Figures, Message } from "./store";

function element<K extends keyof HTMLElementTagNameMap>(tag: K, className = "", text = ""): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

function figureSpans(figures: Figures): HTMLElement[] {
  const shown: [string, string, number | string | null][] = [
    ["ttft", "TTFT", figures.ttftMs === null ? null : `${Math.round(figures.ttftMs)} ms`],
    ["tps", "tok/s", figures.tokensPerSecond === null ? null : figures.tokensPerSecond.toFixed(1)],
    ["tokens", "tokens", figures.completionTokens],
    ["prompt", "prompt", figures.promptTokens],
    ["cached", "cached", figures.cachedTokens],
    ["finish", "finish", figures.finishReason],
  ];
  return shown
    .filter(([, , value]) => value !== null)
    .map(([key, label, value]) => {
      const span = element("span", "", `${label}: ${value}`);
      span.dataset.figure = key;
      return span;
    });
}

export interface MessageActions {
  copy?: () => void;
  regenerate?: () => void;
}

/** Fills `item` (an <li>) with `message`; called again as an answer streams in. */
export function renderMessage(item: HTMLElement, message: Message, raw: boolean, actions: MessageActions): void {
  item.className = `message ${message.role}${raw ? " raw" : ""}`;
  item.dataset.state = message.state ?? "done";
  const who = element("div", "who", message.role === "user" ? "You" : (message.model ?? "assistant"));
  const parts: HTMLElement[] = [who];
  if (message.reasoning) {
    const details = element("details", "reasoning");
    details.open = item.querySelector("details.reasoning")?.hasAttribute("open") ?? false; // keep the reader's choice
    details.append(element("summary", "", "Reasoning"), element("div", "text", message.reasoning));
    parts.push(details);
  }
  const content = element("div", "content");
  if (message.role === "assistant" && !raw) content.innerHTML = renderMarkdown(message.content);
  else content.textContent = message.content;
  parts.push(content);
  for (const call of message.toolCalls ?? []) {
    const card = element("div", "tool-call");
    let args = call.arguments;
    try {
      args = JSON.stringify(JSON.parse(call.arguments), null, 2);
    } catch {
      // still streaming, or not JSON: show it as it came
    }
    card.append(element("span", "name", `${call.name}()`), element("pre", "", args));
    parts.push(card);
  }
  if (message.figures) {
    const figures = element("div", "figures");
    figures.append(...figureSpans(message.figures));
    parts.push(figures);
  }
  if (message.role === "assistant" && message.state !== "streaming") {
    const tools = element("div", "tools");
    for (const [name, action] of Object.entries(actions)) {
      const button = element("button", name, name === "copy" ? "Copy" : "Regenerate");
      button.type = "button";
      button.onclick = action;
      tools.append(button);
    }
    parts.push(tools);
  }
  item.replaceChildren(...parts);
}
