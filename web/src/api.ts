// The server's HTTP API as the pages use it: the API key (kept in session storage, sent as a Bearer
// header, never in a URL), JSON calls, and server-sent event streams read from fetch.

const KEY_STORAGE = "folio.apiKey";

export class AuthError extends Error {}

export class APIError extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
  }
}

export function apiKey(): string | null {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function setAPIKey(key: string | null): void {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

function headers(json: boolean): Headers {
  const result = new Headers();
  const key = apiKey();
  if (key) result.set("Authorization", `Bearer ${key}`);
  if (json) result.set("Content-Type", "application/json");
  return result;
}

async function failure(response: Response): Promise<Error> {
  if (response.status === 401) return new AuthError("the server needs an API key");
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body?.error?.message ?? body?.error ?? message;
  } catch {
    // not JSON: keep the status line
  }
  return new APIError(response.status, String(message));
}

export async function getText(path: string, signal?: AbortSignal): Promise<string> {
  const response = await fetch(path, { headers: headers(false), signal });
  if (!response.ok) throw await failure(response);
  return response.text();
}

export async function getJSON<T>(path: string, signal?: AbortSignal): Promise<T> {
  return JSON.parse(await getText(path, signal)) as T;
}

export interface ModelCard {
  id: string;
  parent?: string | null;
  owned_by?: string;
}

export async function listModels(): Promise<ModelCard[]> {
  const body = await getJSON<{ data: ModelCard[] }>("/v1/models");
  return body.data;
}

/** POSTs `body` and yields each server-sent event's JSON payload until `[DONE]` (or the stream ends).
 * Aborting `signal` closes the connection, which the server takes as the client hanging up. */
export async function* streamEvents(path: string, body: object, signal: AbortSignal): AsyncGenerator<any> {
  const response = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!response.ok || response.body === null) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += value;
    let end: number;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const block = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data === "") continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new APIError(0, payload.error.message ?? String(payload.error));
      yield payload;
    }
  }
}
