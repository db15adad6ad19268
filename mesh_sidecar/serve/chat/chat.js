// The chooser at "/": lists the mesh's models (GET /v1/models), each a link to its chat page.
"use strict";

const KEY_STORAGE = "mesh-inference-api-key"; // the dashboard's too (sessionStorage: gone when the tab closes)

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
  sessionStorage.setItem(KEY_STORAGE, document.getElementById("key-input").value);
  listModels();
});
listModels();
