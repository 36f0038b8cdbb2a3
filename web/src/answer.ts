// One answer: the request a conversation and the settings make (chat, or a raw completion), streamed
// into the assistant message as it arrives, with the figures the page can measure itself (TTFT and
// tokens/s as seen here) and those the server reports (token counts, cache hits, finish reason).

import { streamEvents } from "./api";
import type { Conversation, Figures, Message, Settings, ToolCall } from "./store";

export class SettingsError extends Error {}

function number(text: string, name: string, integer = false): number | undefined {
  if (text.trim() === "") return undefined;
  const value = Number(text);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    throw new SettingsError(`${name} must be ${integer ? "a whole number" : "a number"}`);
  }
  return value;
}

/** The sampling and structured-output fields of a request; SettingsError names a bad setting. */
export function samplingFields(settings: Settings): Record<string, unknown> {
  const fields: Record<string, unknown> = {
    temperature: number(settings.temperature, "Temperature"),
    top_p: number(settings.topP, "Top-p"),
    top_k: number(settings.topK, "Top-k", true),
    max_tokens: number(settings.maxTokens, "Max tokens", true),
    seed: number(settings.seed, "Seed", true),
  };
  const stop = settings.stop
    .split(",")
    .map((s) => s.trim())
    .filter((s) => s !== "");
  if (stop.length > 0) fields.stop = stop;
  if (settings.constraintKind === "json_schema") {
    let schema: unknown;
    try {
      schema = JSON.parse(settings.constraint);
    } catch (error) {
      throw new SettingsError(`the JSON schema is not valid JSON: ${(error as Error).message}`);
    }
    fields.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  } else if (settings.constraintKind === "regex") {
    if (settings.constraint === "") throw new SettingsError("the regex is empty");
    fields.structured_outputs = { regex: settings.constraint };
  }
  return Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== undefined));
}

/** The tools the model may call (chat only), from the settings' JSON array. */
export function toolFields(settings: Settings): Record<string, unknown> {
  if (settings.tools.trim() === "") return {};
  let tools: unknown;
  try {
    tools = JSON.parse(settings.tools);
  } catch (error) {
    throw new SettingsError(`the tools are not valid JSON: ${(error as Error).message}`);
  }
  if (!Array.isArray(tools)) throw new SettingsError("the tools must be a JSON array of tool definitions");
  return { tools, tool_choice: settings.toolChoice };
}

function chatMessages(conversation: Conversation, system: string): object[] {
  const messages: object[] = system.trim() ? [{ role: "system", content: system }] : [];
  for (const message of conversation.messages) {
    if (message.state === "streaming") continue;
    messages.push({ role: message.role, content: message.content });
  }
  return messages;
}

function emptyFigures(): Figures {
  return {
    ttftMs: null,
    tokensPerSecond: null,
    promptTokens: null,
    completionTokens: null,
    cachedTokens: null,
    finishReason: null,
  };
}

/** Streams the answer to `conversation` into `answer`, calling `changed` after each piece. */
export async function streamAnswer(
  conversation: Conversation,
  settings: Settings,
  answer: Message,
  signal: AbortSignal,
  changed: () => void,
): Promise<void> {
  const raw = conversation.mode === "raw";
  const common = { model: settings.model, stream: true, stream_options: { include_usage: true } };
  const body = raw
    ? { ...common, ...samplingFields(settings), prompt: conversation.messages.at(-2)?.content ?? "" }
    : {
        ...common,
        ...samplingFields(settings),
        ...toolFields(settings),
        messages: chatMessages(conversation, settings.system),
      };
  const figures = (answer.figures = emptyFigures());
  const calls: ToolCall[] = [];
  const sent = performance.now();
  let first: number | null = null;
  let last = sent;
  let pieces = 0;
  for await (const chunk of streamEvents(raw ? "/v1/completions" : "/v1/chat/completions", body, signal)) {
    const choice = chunk.choices?.[0];
    if (chunk.usage) {
      figures.promptTokens = chunk.usage.prompt_tokens ?? null;
      figures.completionTokens = chunk.usage.completion_tokens ?? null;
      figures.cachedTokens = chunk.usage.prompt_tokens_details?.cached_tokens ?? null;
    }
    if (!choice) continue;
    const text: string = raw ? (choice.text ?? "") : (choice.delta?.content ?? "");
    const reasoning: string = choice.delta?.reasoning_content ?? "";
    for (const call of choice.delta?.tool_calls ?? []) {
      const known = (calls[call.index] ??= { name: "", arguments: "" });
      known.name += call.function?.name ?? "";
      known.arguments += call.function?.arguments ?? "";
    }
    if (text || reasoning || choice.delta?.tool_calls) {
      const now = performance.now();
      first ??= now;
      last = now;
      pieces += 1;
      answer.content += text;
      if (reasoning) answer.reasoning = (answer.reasoning ?? "") + reasoning;
      if (calls.length > 0) answer.toolCalls = calls;
    }
    if (choice.finish_reason) figures.finishReason = choice.finish_reason;
    if (first !== null) {
      figures.ttftMs = first - sent;
      const tokens = (figures.completionTokens ?? pieces) - 1;
      figures.tokensPerSecond = last > first && tokens > 0 ? (tokens * 1000) / (last - first) : null;
    }
    changed();
  }
  if (first !== null && figures.completionTokens !== null && last > first && figures.completionTokens > 1) {
    figures.tokensPerSecond = ((figures.completionTokens - 1) * 1000) / (last - first);
  }
  changed();
}
