// The API-key login both pages share. The pages themselves are public (static files with no data in
// them); everything they fetch needs the key when the server has one. The key lives in session storage,
// so it is gone when the tab closes, and it is only ever sent in the Authorization header.

import { AuthError, apiKey, setAPIKey } from "./api";

/** Runs `probe` (a call that needs the key); while it fails for want of a key, asks for one. */
export async function withLogin<T>(probe: () => Promise<T>): Promise<T> {
  for (;;) {
    try {
      const result = await probe();
      hide();
      return result;
    } catch (error) {
      if (!(error instanceof AuthError)) throw error;
      const hadKey = apiKey() !== null;
      setAPIKey(null);
      setAPIKey(await ask(hadKey ? "That key was not accepted. Try again:" : "This server needs its API key:"));
    }
  }
}

function dialog(): HTMLFormElement {
  return document.getElementById("login") as HTMLFormElement;
}

function hide(): void {
  dialog().hidden = true;
}

function ask(prompt: string): Promise<string> {
  const form = dialog();
  const input = form.querySelector("input") as HTMLInputElement;
  (form.querySelector(".login-prompt") as HTMLElement).textContent = prompt;
  form.hidden = false;
  input.value = "";
  input.focus();
  return new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (key) resolve(key);
    };
  });
}

export function logOutButton(button: HTMLButtonElement): void {
  button.hidden = apiKey() === null;
  button.onclick = () => {
    setAPIKey(null);
    location.reload();
  };
}
