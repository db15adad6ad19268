// The chooser at "/": lists the mesh's models (GET /v1/models), each a link to its chat page.
"use strict";

const KEY_STORAGE = "mesh-inference-api-key"; // the dashboard's too (sessionStorage: gone when the tab closes)
// llama.cpp's page keeps its settings, its API key among them, in this localStorage entry (same origin).
const UI_CONFIG_STORAGE = "LlamaCppWebui.config";

// A key this node admitted goes to llama.cpp's page too, so it is entered once.
function shareKeyWithThePage(key) {
  let config = {};
  try {
    config = JSON.parse(localStorage.getItem(UI_CONFIG_STORAGE) || "{}") || {};
  } catch (error) {
    config = {};
  }
  if (config.apiKey !== key) localStorage.setItem(UI_CONFIG_STORAGE, JSON.stringify({ ...config, apiKey: key }));
}

function headers() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function listModels() {
  const state = document.getElementById("models-state");
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    document.getElementById("key-form").hidden = false;
    state.textContent = "";
    if (sessionStorage.getItem(KEY_STORAGE)) {
      document.getElementById("key-error").textContent = "That key was refused.";
    }
    return;
  }
  document.getElementById("key-form").hidden = true;
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (response.ok && key) shareKeyWithThePage(key);
  const models = response.ok ? (await response.json()).data : [];
  const list = document.getElementById("models");
  list.replaceChildren(...models.map((model) => {
    const item = document.createElement("li");
    const link = document.createElement("a");
    link.href = `/chat/${encodeURIComponent(model.id)}/`;
    link.textContent = model.id;
    link.dataset.model = model.id;
    item.append(link);
    return item;
  }));
  state.textContent = models.length ? "" : "No model is served in the mesh yet; this page lists one once a member serves it.";
  if (!models.length) setTimeout(listModels, 2000);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = document.getElementById("key-input").value;
  sessionStorage.setItem(KEY_STORAGE, key);
  listModels();
});
listModels();
