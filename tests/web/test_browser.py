"""The web client in real headless Chromium with a fake microphone, against `duplex serve`."""

import os
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
from playwright.async_api import async_playwright

from duplex.bench.synth import babble
from duplex.media import float_to_pcm16

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("DUPLEX_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
RATE = 48000


def fake_microphone(path: Path) -> Path:
    """Speech then silence; Chromium loops the file, so turns keep coming. Synthetic speech
    tells the end-of-turn model nothing, so the silence outlasts semantic_vad's longest wait."""
    audio = np.concatenate([np.zeros(RATE // 2), babble(RATE * 2, rate=RATE, seed=31), np.zeros(RATE * 5)])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(float_to_pcm16(np.clip(audio, -1, 1)))
    return path


def chromium_args(mic: Path) -> list[str]:
    """Headless Chromium granting a fake microphone that plays `mic` in a loop."""
    return [
        "--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={mic}",
        "--allow-loopback-in-peer-connection",
        "--disable-features=WebRtcHideLocalIpsWithMdns",
        "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--autoplay-policy=no-user-gesture-required",
    ]


@pytest.mark.slow
async def test_page_connects_talks_and_shows_the_reply(server_process, tmp_path):
    server = server_process("--model", "echo")
    mic = fake_microphone(tmp_path / "mic.wav")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=chromium_args(mic))
        page = await browser.new_page()
        try:
            await page.goto(server.url)
            await page.wait_for_function("document.getElementById('server').textContent.includes('model echo')")
            await page.click("#connect")
            await page.wait_for_function("window.duplex.state === 'listening' || window.duplex.state === 'speaking'", timeout=20_000)
            await page.wait_for_function("window.duplex.events.includes('output_audio_buffer.started')", timeout=30_000)
            await page.wait_for_function("window.duplex.audioBytesReceived > 5000", timeout=20_000)
            await page.wait_for_selector("#transcript .assistant .text:text('frame0')", timeout=20_000)
            await page.wait_for_function(
                "document.querySelector('#timings td[data-t=\"codec_first_audio\"]').textContent.endsWith('ms')"
            )
            user_lines = await page.locator("#transcript .user").count()
            assert user_lines >= 1
            assert await page.locator("#problem").is_hidden()
            # The page asks for semantic turn detection (the server starts WebRTC calls with
            # the Realtime API's default, server_vad).
            assert await page.evaluate("window.duplex.turnDetection") == "semantic_vad"
        finally:
            await page.screenshot(path=str(ARTIFACTS / "browser-session.png"), full_page=True)
            await browser.close()


@pytest.mark.slow
async def test_page_with_the_full_duplex_switch_on_hears_and_answers_at_once(server_process,
                                                                             tmp_path):
    """Echo in native duplex repeats the caller a frame later: its reply starts while the
    caller is still speaking (by turns it would wait for the end of speech) and keeps coming
    while the microphone keeps sending."""
    server = server_process("--model", "echo")
    mic = fake_microphone(tmp_path / "mic.wav")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=chromium_args(mic))
        page = await browser.new_page()
        try:
            await page.goto(server.url)
            await page.wait_for_function("!document.getElementById('duplex').disabled")
            assert not await page.is_checked("#duplex")
            await page.check("#duplex")
            await page.click("#connect")
            await page.wait_for_function("window.duplex.events.includes('session.updated')",
                                         timeout=20_000)
            await page.wait_for_function(
                "window.duplex.events.includes('input_audio_buffer.speech_stopped')",
                timeout=30_000)
            events = await page.evaluate("window.duplex.events")
            # The model spoke before the caller's speech ended: nothing waited for a turn.
            assert "response.created" in events, events
            assert (events.index("response.created")
                    < events.index("input_audio_buffer.speech_stopped")), events
            assert "response.output_audio.delta" not in events  # WebRTC carries the audio
            await page.wait_for_selector("#transcript .assistant .text:text('frame')",
                                         timeout=20_000)
            # The microphone loops: speech comes round again and so does the echo of it.
            replies = events.count("response.created")
            await page.wait_for_function(
                f"window.duplex.events.filter(t => t === 'response.created').length > {replies}",
                timeout=30_000)
            received = await page.evaluate("window.duplex.audioBytesReceived")
            await page.wait_for_function(f"window.duplex.audioBytesReceived > {received}",
                                         timeout=10_000)
            events = await page.evaluate("window.duplex.events")
            assert "response.done" in events and "error" not in events, events
            assert await page.locator("#problem").is_hidden()
        finally:
            await page.screenshot(path=str(ARTIFACTS / "browser-duplex.png"), full_page=True)
            await browser.close()


@pytest.mark.slow
async def test_page_explains_a_denied_microphone_a_full_server_and_a_dead_one(server_process, tmp_path):
    import os as _os

    env = {**_os.environ, "DUPLEX_ENGINE__MAX_SESSIONS": "1"}
    server = server_process("--model", "echo", env=env)
    mic = fake_microphone(tmp_path / "mic.wav")
    common = ["--no-sandbox", "--disable-gpu", "--use-fake-device-for-media-stream",
              f"--use-file-for-fake-audio-capture={mic}", "--allow-loopback-in-peer-connection",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--no-first-run"]
    async with async_playwright() as p:
        # Without --use-fake-ui-for-media-stream nobody grants the microphone.
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=common)
        page = await browser.new_page()
        await page.goto(server.url)
        await page.click("#connect")
        await page.wait_for_selector("#problem:text('Microphone permission was denied')", timeout=15_000)
        assert await page.is_enabled("#connect")
        await browser.close()

        browser = await p.chromium.launch(
            executable_path=CHROMIUM, args=[*common, "--use-fake-ui-for-media-stream"]
        )
        first, second = await browser.new_page(), await browser.new_page()
        for page in (first, second):
            await page.goto(server.url)
        await first.click("#connect")
        await first.wait_for_function("window.duplex.state === 'listening'", timeout=20_000)
        await second.click("#connect")
        await second.wait_for_selector("#problem:text('The server is full right now')", timeout=15_000)
        await second.screenshot(path=str(ARTIFACTS / "browser-server-full.png"))
        server.proc.kill()
        server.proc.wait()
        await second.click("#connect")
        await second.wait_for_selector("#problem:text('Could not reach the server')", timeout=15_000)
        await browser.close()
