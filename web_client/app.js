// The duplex browser client: WebRTC audio (and optional camera) with OpenAI Realtime
// signalling; events on the "oai-events" data channel.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  connect: $("connect"), hangup: $("hangup"), camera: $("camera"), duplex: $("duplex"),
  turns: $("turns"),
  state: $("state"),
  problem: $("problem"), transcript: $("transcript"), reply: $("reply"),
  received: $("received"), preview: $("preview"), server: $("server"),
};
// Exposed for tests and the curious: what this page has seen.
window.duplex = { events: [], audioBytesReceived: 0, state: "idle", turnDetection: null };

let pc = null, channel = null, callPath = null, media = null, statsTimer = null;
let assistantLine = null, userLine = null, interruptedTimer = null;

let duplexDefault = false;

fetch("/healthz").then((r) => r.json()).then((h) => {
  ui.server.textContent = `model ${h.model} · ${h.active_sessions} active sessions · v${h.version}`;
  // Native duplex is offered where the model runs it; the server's default mode is preset.
  ui.duplex.disabled = !h.duplex;
  duplexDefault = ui.duplex.checked = Boolean(h.duplex_default);
}).catch(() => { ui.server.textContent = "the server does not answer"; });

function setState(state, label) {
  window.duplex.state = state;
  ui.state.className = `state ${state}`;
  ui.state.textContent = label || state;
}

function showProblem(text) {
  ui.problem.textContent = text;
  ui.problem.hidden = !text;
}

function line(role, text) {
  const li = document.createElement("li");
  li.className = role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  li.append(who, body);
  ui.transcript.append(li);
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
  return li;
}

function explainMediaError(err) {
  if (err.name === "NotAllowedError") return "Microphone permission was denied. Allow it in the browser and try again.";
  if (err.name === "NotFoundError") return "No microphone was found on this device.";
  if (err.name === "NotReadableError") return "The microphone is in use by another program.";
  return `The microphone could not be opened: ${err.message}`;
}

async function connect() {
  showProblem("");
  ui.connect.disabled = true;
  try {
    media = await navigator.mediaDevices.getUserMedia({ audio: true, video: ui.camera.checked });
  } catch (err) {
    showProblem(explainMediaError(err));
    ui.connect.disabled = false;
    return;
  }
  if (ui.camera.checked) { ui.preview.srcObject = media; ui.preview.hidden = false; }
  pc = new RTCPeerConnection({ iceServers: [] });
  media.getTracks().forEach((t) => pc.addTrack(t, media));
  pc.ontrack = (e) => { ui.reply.srcObject = e.streams[0] || new MediaStream([e.track]); };
  pc.onconnectionstatechange = () => {
    if (pc && (pc.connectionState === "failed" || pc.connectionState === "disconnected")) {
      showProblem("The connection to the server was lost.");
      teardown();
    }
  };
  channel = pc.createDataChannel("oai-events");
  channel.onmessage = (e) => onEvent(JSON.parse(e.data));
  channel.onopen = () => {
    // Turns end when a model judges the speaker finished (semantic_vad) unless the page is
    // told otherwise; the server is told only where that differs from how it starts calls.
    const type = ui.duplex.checked ? "duplex" : ui.turns.value;
    if (type === (duplexDefault ? "duplex" : "server_vad")) return;
    channel.send(JSON.stringify({ type: "session.update", session: { type: "realtime",
      audio: { input: { turn_detection: { type } } } } }));
  };  try {
    await pc.setLocalDescription(await pc.createOffer());
    // Per-stage timings come as duplex's own event, off unless a client asks for it.
    const resp = await fetch("/v1/realtime/calls?duplex_events=1", {
      method: "POST", body: pc.localDescription.sdp, headers: { "Content-Type": "application/sdp" },
    });
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      const why = (body.error && body.error.message) || resp.statusText;
      throw new Error(resp.status === 429 ? `The server is full right now: ${why}` : `The server refused the call: ${why}`);
    }
    callPath = resp.headers.get("Location");
    await pc.setRemoteDescription({ type: "answer", sdp: await resp.text() });
  } catch (err) {
    showProblem(err.message.startsWith("The server") ? err.message : `Could not reach the server: ${err.message}`);
    teardown();
    return;
  }
  ui.hangup.disabled = false;
  setState("listening");
  statsTimer = setInterval(pollStats, 500);
}

async function pollStats() {
  if (!pc) return;
  const stats = await pc.getStats();
  stats.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") {
      window.duplex.audioBytesReceived = s.bytesReceived;
      ui.received.textContent = `${(s.bytesReceived / 1024).toFixed(1)} KB`;
    }
    if (s.type === "candidate-pair" && s.state === "succeeded" && s.currentRoundTripTime !== undefined) {
      window.duplex.networkMs = s.currentRoundTripTime * 500;
    }
  });
}

function onEvent(ev) {
  window.duplex.events.push(ev.type);
  switch (ev.type) {
    case "session.created":
    case "session.updated": {
      const td = ev.session.audio && ev.session.audio.input.turn_detection;
      window.duplex.turnDetection = td ? td.type : null;
      break;
    }
    case "input_audio_buffer.speech_started":
      userLine = line("user", "speaking...");
      userLine.dataset.start = ev.audio_start_ms;
      break;
    case "input_audio_buffer.speech_stopped":
      if (userLine) {
        const seconds = (ev.audio_end_ms - Number(userLine.dataset.start)) / 1000;
        userLine.querySelector(".text").textContent = `(spoke ${seconds.toFixed(1)} s)`;
      }
      break;
    case "response.created":
      assistantLine = line("assistant", "");
      break;
    case "response.output_audio_transcript.delta":
      if (assistantLine) assistantLine.querySelector(".text").textContent += ev.delta;
      break;
    case "output_audio_buffer.started":
      clearTimeout(interruptedTimer);
      setState("speaking");
      break;
    case "output_audio_buffer.stopped":
      setState("listening");
      break;
    case "response.done":
      if (ev.response.status === "cancelled" && assistantLine) {
        const heard = ev.response.output && ev.response.output[0] && ev.response.output[0].content[0].transcript;
        if (heard !== undefined && heard !== null) assistantLine.querySelector(".text").textContent = heard;
        const cut = document.createElement("span");
        cut.className = "cut";
        cut.textContent = "(interrupted)";
        assistantLine.append(cut);
        setState("interrupted");
        interruptedTimer = setTimeout(() => setState("listening"), 1500);
      }
      break;
    case "duplex.response.timings":
      for (const [name, ms] of Object.entries(ev.timings_ms)) {
        const cell = document.querySelector(`#timings td[data-t="${name}"]`);
        if (cell) cell.textContent = `${ms.toFixed(0)} ms`;
      }
      if (window.duplex.networkMs !== undefined) {
        document.querySelector('#timings td[data-t="network"]').textContent = `${window.duplex.networkMs.toFixed(0)} ms`;
      }
      break;
    case "error":
      showProblem(`Server error: ${ev.error.message}`);
      break;
  }
}

function teardown() {
  clearInterval(statsTimer);
  if (pc) pc.close();
  if (media) media.getTracks().forEach((t) => t.stop());
  pc = channel = media = null;
  ui.connect.disabled = false;
  ui.hangup.disabled = true;
  ui.preview.hidden = true;
  setState("idle", "not connected");
}

async function hangup() {
  if (callPath) await fetch(`${callPath}/hangup`, { method: "POST" }).catch(() => {});
  callPath = null;
  teardown();
}

ui.connect.addEventListener("click", connect);
ui.hangup.addEventListener("click", hangup);
