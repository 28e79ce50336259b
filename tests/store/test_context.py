"""The model-context record: replies kept as heard (the playback watermark, a barge-in), user
audio kept losslessly on the grid the model hears, the byte cap's policy."""

import base64
import json

import numpy as np

from duplex.store import StoredContext
from duplex.store.context import (
    AudioSpan,
    ContextRecord,
    ReplySpan,
    TextSpan,
    decode_flac,
    encode_flac,
    from_pcm16,
    quantize,
)
from duplex.transport.realtime.protocol import RealtimeProtocol

RATE = 24000
FRAME = 1920


def protocol():
    p = RealtimeProtocol("sess_1", model="tiny", model_input_rate=16000, model_output_rate=RATE)
    p.start()
    p.receive_text(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}}))
    return p


def generate(p, record, frames, first_id=100, place=0):
    """A reply whose engine has generated `frames` frames, one token each (the first the
    reply's `place`-th), none played yet."""
    audio = np.zeros(RATE // 5, "<i2").tobytes()
    p.receive_text(json.dumps({"type": "input_audio_buffer.append",
                               "audio": base64.b64encode(audio).decode()}))
    p.receive_text('{"type": "response.create"}')
    r = p.response
    record.reply(r.core_id, r.epoch, "be brief", (), p.clock.tempo.speed)
    for i in range(frames):
        record.tokens(r.epoch, (first_id + i,), i * FRAME, place + i)
        p.on_engine_audio(r.epoch, np.zeros(FRAME, np.float32), f"w{i} ")
    return r.epoch


def play(p, seconds):
    now = int(seconds * RATE)
    for t in range(0, now + 1, 480):
        p.release_output(t)
    return now


def through_json(stored):
    """`stored` as another node reads it from the registry."""
    return StoredContext(json.loads(json.dumps(stored.index)), dict(stored.parts),
                         tuple(stored.names))


def load(stored, max_bytes=1 << 20):
    return ContextRecord.from_record(through_json(stored), 16000, RATE, RATE, max_bytes)


def saved_reply(record, p, now):
    stored = record.to_record(lambda core_id: p.heard(core_id, now))
    return [s.heard_ids(None, 1.0) for s in load(stored).spans if isinstance(s, ReplySpan)]


def test_generated_but_unheard_tokens_stay_out_of_the_saved_context():
    p, record = protocol(), ContextRecord(16000, RATE, RATE, 1 << 20)
    generate(p, record, frames=25)
    now = play(p, 0.5)
    # 0.5 s played of 80 ms frames: frames 0..6 had started; the other 18 were generated only.
    [reply] = saved_reply(record, p, now)
    assert reply == list(range(100, 107))
    assert len(p.snapshot(now)[0][-1]["transcript"].split()) == len(reply)


def test_a_faster_reply_keeps_what_was_heard_in_the_listeners_time():
    p, record = protocol(), ContextRecord(16000, RATE, RATE, 1 << 20)
    p.receive_text(json.dumps({"type": "session.update", "session": {
        "audio": {"output": {"speed": 1.5}}}}))
    generate(p, record, frames=25)
    now = play(p, 0.5)
    # 0.5 s heard at speed 1.5 is 0.75 s of the reply: frames 0..9 had started.
    [reply] = saved_reply(record, p, now)
    assert reply == list(range(100, 110))
    assert len(p.snapshot(now)[0][-1]["transcript"].split()) == len(reply)


def test_a_barge_in_fixes_what_was_heard_and_later_tokens_do_not_join():
    p, record = protocol(), ContextRecord(16000, RATE, RATE, 1 << 20)
    epoch = generate(p, record, frames=10)
    now = play(p, 0.3)
    p.receive_text('{"type": "output_audio_buffer.clear"}')
    # Tokens the engine still had on their way when the reply was cut.
    record.tokens(epoch, (999,), 10 * FRAME, 10)
    [reply] = saved_reply(record, p, now + RATE)
    assert reply == list(range(100, 104))


def test_a_reply_heard_in_full_is_kept_whole_and_survives_a_save_and_load():
    p, record = protocol(), ContextRecord(16000, RATE, RATE, 1 << 20)
    record.instruct("be brief", ())
    pcm = quantize(np.random.default_rng(1).uniform(-0.4, 0.4, 16000).astype(np.float32))
    record.audio(pcm)
    generate(p, record, frames=5)
    record.tokens(p.response.epoch, (7, 8), None, 5)  # a tool call's tokens, never voiced
    p.on_engine_finished(p.response.epoch)
    now = play(p, 2.0)
    record.text("the tool said 3", "tool")
    loaded = load(record.to_record(lambda core_id: p.heard(core_id, now)))
    assert loaded.head == ("be brief", ())
    audio = loaded.spans[0].pcm()
    # The model hears `quantize`d audio; the record gives it back bit for bit.
    assert from_pcm16(audio).tobytes() == pcm.tobytes()
    assert loaded.spans[1].heard_ids(None, 1.0) == [100, 101, 102, 103, 104, 7, 8]
    assert (loaded.spans[2].text, loaded.spans[2].role) == ("the tool said 3", "tool")
    summary = loaded.summary()
    assert (summary.items, summary.audio_seconds, summary.left_out) == (3, 1.0, 0)


def test_tokens_kept_in_the_reply_order_whatever_order_they_arrive_in():
    # A tool call's tokens go out as the Thinker writes them; the speech before them only
    # with its audio, later.
    p, record = protocol(), ContextRecord(16000, RATE, RATE, 1 << 20)
    epoch = generate(p, record, frames=3, place=2)
    record.tokens(epoch, (7, 8), None, 0)
    p.on_engine_finished(epoch)
    now = play(p, 1.0)
    assert saved_reply(record, p, now) == [[7, 8, 100, 101, 102]]
    # A gap (tokens still on their way) ends what is kept, as an unheard token does.
    p2, record2 = protocol(), ContextRecord(16000, RATE, RATE, 1 << 20)
    generate(p2, record2, frames=3, place=2)
    assert saved_reply(record2, p2, play(p2, 1.0)) == [[]]
    # A reply nobody heard a token of is no item put back.
    assert load(record2.to_record(lambda core_id: p2.heard(core_id, RATE))).summary().items == 0


def test_flac_is_lossless_and_smaller_than_the_samples_for_speech_like_audio():
    t = np.arange(16000 * 2) / 16000
    pcm = (np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t) * 12000).astype(np.int16)
    blob = encode_flac(pcm, 16000)
    assert np.array_equal(decode_flac(blob), pcm)
    assert len(blob) < pcm.nbytes / 2


def test_past_the_byte_cap_the_oldest_turns_are_left_out_and_counted():
    record = ContextRecord(16000, RATE, RATE, max_bytes=60_000)
    rng = np.random.default_rng(2)
    record.instruct("be brief", ())
    for turn in range(3):
        record.audio(quantize(rng.uniform(-0.5, 0.5, 16000).astype(np.float32)))
        record.text(f"turn {turn}", "user")
    stored = record.to_record(lambda core_id: None)
    # One second of noise is ~40 kB of base64 FLAC: the oldest entries go until the rest
    # fits, which leaves the newest audio and the texts around it.
    loaded = load(stored, 60_000)
    assert [getattr(s, "text", None) for s in loaded.spans] == ["turn 1", None, "turn 2"]
    assert loaded.head == ("be brief", ()) and loaded.summary().left_out == 3
    # What was left out is in the registry no more.
    assert len(stored.parts) == 4 and sum(map(len, stored.parts.values())) < 60_000


def test_long_audio_is_kept_in_blocks_encoded_once_and_comes_back_whole():
    record = ContextRecord(16000, RATE, RATE, 1 << 24)
    rng = np.random.default_rng(3)
    pcm = quantize(rng.uniform(-0.2, 0.2, 16000 * 25).astype(np.float32))
    for part in np.array_split(pcm, 50):  # as the session pushes it, a piece at a time
        record.audio(part)
    first = record.to_record(lambda core_id: None)
    [[blocks]] = [e.values() for e in first.index["entries"]]
    record.audio(pcm[:1600])
    again = record.to_record(lambda core_id: None)
    [[names]] = [e.values() for e in again.index["entries"]]
    # Nothing saved is encoded or named again: the 0.1 s since is one more piece.
    assert names[:3] == blocks and len(names) == 4
    assert {n: again.parts[n] for n in blocks} == {n: first.parts[n] for n in blocks}
    assert [int(again.parts[n].split(":")[0]) for n in names] == [160000, 160000, 80000, 1600]
    loaded = load(again, 1 << 24)
    restored = from_pcm16(loaded.spans[0].pcm())
    assert restored.tobytes() == np.concatenate([pcm, pcm[:1600]]).tobytes()
    assert loaded.summary().audio_seconds == 25.1
    # Once a block is full it takes the pieces' place.
    record.audio(pcm[: 16000 * 5])
    full = record.to_record(lambda core_id: None)
    [[names]] = [e.values() for e in full.index["entries"]]
    assert names[:2] == blocks[:2] and len(names) == 4
    assert [int(full.parts[n].split(":")[0]) for n in names] == [160000] * 3 + [1600]
    restored = from_pcm16(load(full, 1 << 24).spans[0].pcm())
    assert restored.tobytes() == np.concatenate([pcm, pcm[:1600], pcm[: 16000 * 5]]).tobytes()


def test_one_long_stretch_of_audio_past_the_cap_loses_its_oldest_blocks_only():
    record = ContextRecord(16000, RATE, RATE, max_bytes=1_000_000)
    rng = np.random.default_rng(4)
    record.text("hello", "user")
    record.audio(quantize(rng.uniform(-0.5, 0.5, 16000 * 60).astype(np.float32)))
    stored = record.to_record(lambda core_id: None)
    # ~420 kB of noise per 10 s block: the text and the oldest four blocks go.
    loaded = load(stored, 1_000_000)
    [span] = loaded.spans
    assert isinstance(span, AudioSpan) and [b.samples for b in span.blocks] == [160000] * 2
    assert loaded.summary().left_out == 1 and loaded.summary().audio_seconds == 20.0


def test_a_loaded_record_keeps_its_names_and_names_what_comes_after_anew():
    record = ContextRecord(16000, RATE, RATE, 1 << 20)
    record.instruct("be brief", ())
    record.text("hi", "user")
    record.audio(quantize(np.full(1600, 0.1, np.float32)))
    stored = record.to_record(lambda core_id: None)
    loaded = load(stored)
    assert loaded.to_record(lambda core_id: None).parts == stored.parts
    loaded.text("again", "user")
    after = loaded.to_record(lambda core_id: None)
    [new] = set(after.parts) - set(stored.parts)
    assert isinstance(loaded.spans[-1], TextSpan) and json.loads(after.parts[new])["text"] == "again"


def test_a_record_of_another_input_rate_is_not_rebuilt_but_its_names_are_not_reused():
    """The registry still holds its parts, and a resumed keeper takes those as held."""
    record = ContextRecord(16000, RATE, RATE, 1 << 20)
    record.instruct("be brief", ())
    record.text("hi", "user")
    stored = record.to_record(lambda core_id: None)
    other = ContextRecord.from_record(stored, 24000, RATE, RATE, 1 << 20)
    assert other.spans == [] and other.head is None
    other.instruct("be brief", ())
    other.text("hi again", "user")
    assert not set(other.to_record(lambda core_id: None).names) & set(stored.names)


def test_a_record_of_the_whole_record_format_resumes_with_its_context():
    """A session saved by a node of the release before incremental saves: the session's
    `context` field held the whole record, and no parts. It comes back whole here, and saves
    on in the incremental format."""
    rng = np.random.default_rng(3)
    block, tail = quantize(rng.uniform(-0.5, 0.5, 160000)), quantize(rng.uniform(-0.5, 0.5, 8000))
    pcm16 = [np.round(x * 32767).astype(np.int16) for x in (block, tail)]
    resampler_tail = rng.standard_normal(63).astype(np.float32)
    whole = {
        "rate": 16000,
        "head": {"instructions": "be brief", "tools": [{"type": "function", "name": "f"}]},
        "entries": [
            {"audio": [base64.b64encode(encode_flac(p, 16000)).decode() for p in pcm16],
             "samples": [len(p) for p in pcm16]},
            {"reply": [5, 6, 7], "instructions": "be brief", "tools": []},
            {"text": "and now?", "role": "user"},
            {"reply": [], "instructions": "", "tools": []},
        ],
        "left_out": 2,
        "resampler": {"fed": 168000, "emitted": 112000,
                      "tail": base64.b64encode(resampler_tail.astype("<f4").tobytes()).decode()},
    }
    record = load(StoredContext(whole, {}, ()))
    assert record.head == ("be brief", ({"type": "function", "name": "f"},))
    audio, reply, text, unheard = record.spans
    assert np.array_equal(audio.pcm(), np.concatenate(pcm16))
    assert reply.heard_ids(None, 1.0) == [5, 6, 7] and unheard.heard_ids(None, 1.0) == []
    assert (text.text, text.role) == ("and now?", "user")
    assert record.summary().wire() == {"items": 3, "audio_seconds": 10.5, "left_out_items": 2,
                                       "kept_live": False}
    state = record.resamplers.model
    assert (state.fed, state.emitted) == (168000, 112000)
    assert np.array_equal(state.tail, resampler_tail)

    stored = record.to_record(lambda core_id: None, record.resamplers)
    # A node of the whole-record release reads the rate under "rate": without it, it takes
    # this record for another model's and resumes without it, rather than failing on it.
    assert "rate" not in stored.index
    again = load(stored)
    assert again.head == record.head and again.summary() == record.summary()
    assert np.array_equal(again.spans[0].pcm(), np.concatenate(pcm16))
    assert [s.heard_ids(None, 1.0) for s in again.spans if isinstance(s, ReplySpan)] == [
        [5, 6, 7], []]


def test_a_long_call_s_live_record_holds_no_more_than_the_cap_lets_it_save():
    """The session keeps recording for an hour; what the cap leaves out of a save is let go
    from the live record too, and counted once however many saves follow."""
    cap = 1_000_000
    record = ContextRecord(16000, RATE, RATE, max_bytes=cap)
    rng = np.random.default_rng(5)
    noise = quantize(rng.uniform(-0.5, 0.5, 16000 * 10).astype(np.float32))
    held = []
    for turn in range(30):  # five minutes: ~12 MB of noise as base64 FLAC
        record.audio(noise)
        record.text(f"turn {turn}", "user")
        stored = record.to_record(lambda core_id: None)
        held.append(sum(len(b.flac) for s in record.spans if isinstance(s, AudioSpan)
                        for b in s.blocks + s.pieces))
    assert max(held) <= cap
    # Each turn (a 10 s block and a text) that went is one item left out, once.
    kept = load(stored, cap)
    assert kept.summary().left_out == record.summary().left_out == 60 - len(kept.spans)
    assert record.to_record(lambda core_id: None).index == stored.index
    assert [s.text for s in kept.spans if isinstance(s, TextSpan)][-1] == "turn 29"
