"""Scenario profiles, time-of-day schedules, ``carpool profiles`` and the
server's per-request character cap."""
from __future__ import annotations

from datetime import datetime, time

import pytest
import yaml
from starlette.testclient import TestClient

from carpool.cli import (
    build_parser,
    engine_config_from_args,
    main,
    server_config_from_args,
)
from carpool.config import EngineConfig
from carpool.profiles import describe, list_profiles, load_profile
from carpool.profiles.schedule import (
    ProfileSchedule,
    active_window,
    next_change,
    parse_schedule,
    settings_at,
)
from carpool.server.config import ServerConfig
from tests.server_utils import in_process_app

SCENARIOS = ["chat", "code", "documents", "translate"]


def _window(name="w", start="09:00", end="11:00", **knobs):
    return {"name": name, "from": start, "to": end, "scheduler": knobs}


def _profile(*windows, **scheduler):
    return {"scheduler": scheduler or {"max_num_seqs": 8}, "cache": {"block_size": 16},
            "schedule": list(windows)}


def _configs(settings: dict) -> tuple[EngineConfig, ServerConfig]:
    engine = EngineConfig.from_dict({k: v for k, v in settings.items() if k != "server"})
    server = ServerConfig(**(settings.get("server") or {}))
    return engine.validate(), server.validate()


# -- built-in profiles ------------------------------------------------------------------

@pytest.mark.parametrize("name", list_profiles())
def test_every_builtin_profile_validates_at_every_window(name):
    schedule = ProfileSchedule.from_profile(load_profile(name))
    assert describe(name), "each profile starts with a comment saying what it is for"
    times = [time(3, 0)] + [time(w.start // 3600, w.start // 60 % 60) for w in schedule.windows]
    for t in times:
        _configs(schedule.settings_at(t))


def test_scenario_profiles_map_the_issue_onto_real_knobs():
    assert set(SCENARIOS) <= set(list_profiles())
    chat, _ = _configs(settings_at(load_profile("chat"), time(14, 0)))
    assert chat.scheduler.batching == "continuous" and chat.scheduler.max_num_seqs == 12
    assert chat.scheduler.session_ttl >= 3600 and chat.cache.enable_prefix_caching
    peak, _ = _configs(settings_at(load_profile("chat"), time(10, 0)))
    assert peak.scheduler.max_num_seqs > chat.scheduler.max_num_seqs
    assert peak.scheduler.max_num_batched_tokens == chat.scheduler.max_num_batched_tokens
    code, _ = _configs(load_profile("code"))
    assert code.scheduler.max_num_seqs == 4 and code.cache.enable_prefix_caching
    documents, _ = _configs(load_profile("documents"))
    assert documents.scheduler.batching == "dynamic"
    assert documents.scheduler.max_batch_size <= documents.scheduler.max_num_seqs
    translate, server = _configs(load_profile("translate"))
    assert translate.scheduler.max_num_seqs == 6 and server.max_prompt_chars == 2000


# -- schedule semantics -----------------------------------------------------------------

def test_window_is_start_inclusive_end_exclusive():
    profile = _profile(_window(max_num_seqs=32))
    for t, expected in [(time(8, 59, 59), 8), (time(9, 0), 32), (time(10, 30), 32),
                        (time(10, 59, 59, 999999), 32), (time(11, 0), 8), (time(23, 0), 8)]:
        assert settings_at(profile, t)["scheduler"]["max_num_seqs"] == expected, t
    assert active_window(profile, time(9, 0)).name == "w"
    assert active_window(profile, time(11, 0)) is None


def test_window_wrapping_midnight():
    profile = _profile(_window("night", "22:00", "06:00", max_num_seqs=64))
    for t, active in [(time(22, 0), True), (time(23, 59), True), (time(0, 0), True),
                      (time(5, 59), True), (time(6, 0), False), (time(12, 0), False),
                      (time(21, 59), False)]:
        assert (active_window(profile, t) is not None) == active, t
    assert next_change(profile, time(23, 0)) == time(6, 0)
    assert next_change(profile, time(7, 0)) == time(22, 0)
    until_midnight = _profile(_window("late", "22:00", "24:00", max_num_seqs=2))
    assert active_window(until_midnight, time(23, 59, 59)) is not None
    assert active_window(until_midnight, time(0, 0)) is None


def test_next_change_is_the_next_boundary_strictly_after():
    profile = _profile(_window("a", "09:00", "11:00", max_num_seqs=2),
                       _window("b", "13:00", "14:30", max_num_seqs=3))
    assert next_change(profile, time(8, 0)) == time(9, 0)
    assert next_change(profile, time(9, 0)) == time(11, 0)  # on a start: its end
    assert next_change(profile, time(11, 0)) == time(13, 0)
    assert next_change(profile, time(14, 30)) == time(9, 0)  # tomorrow's first
    assert next_change(_profile(), time(12, 0)) is None


def test_settings_at_merges_deeply_and_drops_the_schedule():
    profile = _profile(_window(max_num_seqs=32), max_num_seqs=8, policy="priority")
    profile["max_queue_requests"] = 50  # a flat knob in the base
    profile["schedule"][0]["scheduler"]["max_queue_requests"] = 500
    resolved = settings_at(profile, time(10, 0))
    assert "schedule" not in resolved and resolved["cache"] == {"block_size": 16}
    assert resolved["scheduler"] == {"max_num_seqs": 32, "policy": "priority",
                                     "max_queue_requests": 500}
    assert "max_queue_requests" not in resolved  # the window beats the flat base knob
    assert EngineConfig.from_dict(resolved).scheduler.max_queue_requests == 500
    outside = settings_at(profile, time(12, 0))
    assert outside["scheduler"]["max_num_seqs"] == 8 and outside["max_queue_requests"] == 50
    assert profile["scheduler"]["max_num_seqs"] == 8  # the input is not changed


def test_overlapping_windows_are_rejected_touching_ones_are_not():
    with pytest.raises(ValueError, match="'a' .* and 'b' .* overlap"):
        parse_schedule([_window("a", "09:00", "11:00"), _window("b", "10:59", "12:00")])
    with pytest.raises(ValueError, match="overlap"):  # wrapping windows overlap after midnight
        parse_schedule([_window("a", "22:00", "02:00"), _window("b", "01:00", "03:00")])
    with pytest.raises(ValueError, match="overlap"):
        parse_schedule([_window("a", "08:00", "12:00"), _window("b", "09:00", "10:00")])
    windows = parse_schedule([_window("b", "11:00", "13:00"), _window("a", "09:00", "11:00"),
                              _window("c", "23:00", "09:00")])
    assert [w.name for w in windows] == ["a", "b", "c"]


@pytest.mark.parametrize("entry, message", [
    (_window(start="25:00"), "cannot read '25:00'"),
    (_window(start="9am"), "cannot read '9am'"),
    (_window(end="24:30"), "past 24:00"),
    (_window(start="24:00", end="01:00"), "'from' cannot be 24:00"),
    (_window(start=660), "quote it"),  # what YAML makes of an unquoted 11:00
    (_window(start="10:00", end="10:00"), "both 10:00"),
    ({"name": "w", "from": "09:00"}, "needs 'to'"),
    ({"from": "09:00", "to": "10:00"}, "non-empty 'name'"),
    ({**_window(), "cache": {"block_size": 8}}, "unknown key.*cache"),
    (_window(bogus_knob=1), "unknown scheduler knob.*bogus_knob"),
    ("peak", "must be a mapping"),
])
def test_bad_windows_are_rejected(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_schedule([entry])


def test_schedule_errors_name_the_window():
    with pytest.raises(ValueError, match="two windows are named 'w'"):
        parse_schedule([_window(), _window(start="12:00", end="13:00")])
    with pytest.raises(ValueError, match="must be a list"):
        parse_schedule({"name": "w"})
    bad_value = _profile(_window("peak", preferred_batch_size=99))  # > max_batch_size 32
    with pytest.raises(ValueError, match="schedule window 'peak': need 1 <= preferred"):
        ProfileSchedule.from_profile(bad_value)


def test_profile_schedule_for_the_live_controller():
    profile = _profile(_window("peak", max_num_seqs=32, max_queue_requests=400),
                       max_num_seqs=8)
    schedule = ProfileSchedule.from_profile(profile)
    peak, evening = datetime(2024, 5, 6, 10, 15), datetime(2024, 5, 6, 19, 0)
    assert schedule.overrides_at(peak) == {"max_num_seqs": 32, "max_queue_requests": 400}
    assert schedule.overrides_at(evening) == {}
    assert schedule.baseline == {"max_num_seqs": 8, "max_queue_requests": 200}  # 200: default
    assert schedule.knobs_at(evening) == schedule.baseline
    assert schedule.next_change(peak) == time(11, 0)
    pinned = ProfileSchedule.from_profile(profile, pinned={"max_num_seqs"})
    assert pinned.overrides_at(peak) == {"max_queue_requests": 400}
    assert pinned.knobs() == ["max_queue_requests"]


# -- the command line -------------------------------------------------------------------

def _serve_args(*argv: str, at: time):
    args = build_parser().parse_args(["serve", "some/model", *argv])
    args.engine_model = args.model_path
    args.profile_time = at
    return args


def test_precedence_flags_over_window_over_profile_base(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(_profile(
        _window("peak", max_num_seqs=32, max_queue_requests=400, queue_timeout=5.0),
        max_num_seqs=8, max_queue_requests=40, queue_timeout=9.0)))
    flags = ["--profile", str(path), "--max-queue-requests", "7"]
    peak = engine_config_from_args(_serve_args(*flags, at=time(10, 0))).scheduler
    assert peak.max_queue_requests == 7  # flag over window
    assert peak.max_num_seqs == 32 and peak.queue_timeout == 5.0  # window over base
    calm = engine_config_from_args(_serve_args(*flags, at=time(12, 0))).scheduler
    assert calm.max_queue_requests == 7 and calm.max_num_seqs == 8 and calm.queue_timeout == 9.0
    assert calm.policy == "fcfs"  # defaults under all of it


def test_max_prompt_chars_from_profile_and_flag():
    assert server_config_from_args(
        _serve_args("--profile", "translate", at=time(12, 0))).max_prompt_chars == 2000
    flag = _serve_args("--profile", "translate", "--max-prompt-chars", "500", at=time(12, 0))
    assert server_config_from_args(flag).max_prompt_chars == 500
    assert ServerConfig().max_prompt_chars is None
    with pytest.raises(ValueError, match="max_prompt_chars"):
        ServerConfig(max_prompt_chars=0).validate()


def test_profiles_command_lists_descriptions_knobs_and_windows(capsys):
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in list_profiles():
        assert f"{name} " in out and describe(name) in out
    assert "schedule peak 09:00-11:00: max_num_seqs=24" in out
    assert "batching=dynamic" in out and "max_prompt_chars=2000" in out


def test_profiles_command_shows_resolved_yaml_and_the_active_window(capsys):
    assert main(["profiles", "chat", "--at", "10:30"]) == 0
    out = capsys.readouterr().out
    assert "# at 10:30: window 'peak' is active (until 11:00)" in out
    assert yaml.safe_load(out)["scheduler"]["max_num_seqs"] == 24
    assert main(["profiles", "chat", "--at", "12:00"]) == 0
    out = capsys.readouterr().out
    assert "no window is active (next change at 09:00)" in out
    resolved = yaml.safe_load(out)
    assert resolved["scheduler"]["max_num_seqs"] == 12 and "schedule" not in resolved
    assert main(["profiles", "no-such-profile"]) == 2
    assert "unknown profile" in capsys.readouterr().err


# -- the server's character cap ---------------------------------------------------------



def _client(engine, **server_settings) -> TestClient:
    return TestClient(in_process_app(engine, **server_settings), base_url="http://127.0.0.1")


def test_server_rejects_prompts_over_max_prompt_chars(tiny_async_engine):
    with _client(tiny_async_engine, max_prompt_chars=20) as client:
        ok = client.post("/v1/completions", json={"prompt": "x" * 20, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        long = client.post("/v1/completions", json={"prompt": ["x" * 15, "y" * 6],
                                                     "max_tokens": 2})
        assert long.status_code == 400
        error = long.json()["error"]
        assert error["code"] == "prompt_too_long" and error["param"] == "prompt"
        assert "21 characters" in error["message"] and "at most 20" in error["message"]
        tokens = client.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 2})
        assert tokens.status_code == 200, tokens.text  # token ids carry no characters
        chat = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
            {"role": "system", "content": "s" * 10}, {"role": "user", "content": "u" * 11}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    with _client(tiny_async_engine) as client:  # no cap by default
        ok = client.post("/v1/completions", json={"prompt": "x" * 500, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
