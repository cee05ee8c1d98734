"""Budgets parse one way (issue 47): every form of a device budget and of a headroom, accepted or
refused, in one table; a budget above what the device has is taken with one warning.

Bytes are an int >= 1, digits with an optional unit, or a decimal with a unit of KB or more that
comes to whole bytes.  A fraction of the free device memory is a float in (0, 1] or text "N%"
with N in (0, 100].  Text is never a bare fraction.
"""

from __future__ import annotations

import logging

import pytest

from residency import ConfigError
from residency.options.budget import AutoOptions, parse_nbytes

pytestmark = pytest.mark.fast

FREE = 10 * 2**30

#: (device_budget, the budget it resolves to with `FREE` bytes free).
ACCEPTED = [
    (1, 1),
    (2048, 2048),
    ("2048", 2048),
    ("500MB", 500 * 10**6),
    ("500 MB", 500 * 10**6),
    ("38GiB", 38 * 2**30),
    ("1.5GiB", 3 * 2**29),
    ("1.25KB", 1250),
    (0.5, FREE // 2),
    (1.0, FREE),
    ("90%", int(FREE * 0.9)),
    ("100%", FREE),
    ("12.5%", FREE // 8),
    (None, FREE),
]

#: Refused device budgets (each message names both forms).
REFUSED = ["1.5", "2.0", "0.5", "3.7B", "-1", "0", 0, True, False, "abc", "150%", "0%", "-5%",
           1.5, 0.0, -0.5, "1.0001KB", "1.5 parsecs", "", [1], -1]


@pytest.mark.parametrize("budget, expected", ACCEPTED)
def test_each_accepted_budget_form(budget, expected):
    options = AutoOptions(device_budget=budget, headroom=0)
    assert options.resolve(free=FREE) == (expected, 0)
    assert AutoOptions.from_dict(options.to_dict()) == options


@pytest.mark.parametrize("budget", REFUSED)
def test_each_refused_budget_names_both_forms(budget):
    with pytest.raises(ConfigError) as refused:
        AutoOptions(device_budget=budget)
    message = str(refused.value)
    assert message.startswith(f"device_budget={budget!r}; give bytes")
    assert "a size such as '38GiB', '1.5GiB'" in message
    assert "or a fraction of the free device memory: a float in (0, 1] such as 0.9, or a " \
           "percentage such as '90%'" in message
    assert "text is never a bare fraction" in message


@pytest.mark.parametrize("headroom, expected", [
    (0, 0), ("0", 0), ("0GiB", 0), (4096, 4096), ("1.5KiB", 1536), ("2MB", 2 * 10**6)])
def test_headroom_parses_bytes_the_same_way_and_takes_zero(headroom, expected):
    assert AutoOptions(device_budget="1GiB", headroom=headroom).resolve(free=None)[1] == expected


@pytest.mark.parametrize("headroom", ["3.7B", "-1", -1, True, 0.5, "10%", "1.5", "abc"])
def test_refused_headrooms(headroom):
    with pytest.raises(ConfigError, match=r"^headroom=.*; give bytes: a whole number >= 0, or a "
                                          r"size such as '38GiB', '1\.5GiB'"):
        AutoOptions(headroom=headroom)


def test_other_byte_counts_parse_the_same_way():
    assert parse_nbytes("memory_limit", "1.5GiB") == 3 * 2**29
    for refused in ("3.7B", "1.5", "-1", True):
        with pytest.raises(ConfigError, match=r"^memory_limit="):
            parse_nbytes("memory_limit", refused)


def test_a_budget_above_the_devices_total_memory_warns_once_naming_both(caplog):
    options = AutoOptions(device_budget="64GiB")
    with caplog.at_level(logging.WARNING, logger="residency"):
        assert options.resolve(free=FREE, total=23 * 2**30)[0] == 64 * 2**30
    warned = [r.getMessage() for r in caplog.records if "device_budget" in r.getMessage()]
    assert len(warned) == 1
    assert "device_budget='64GiB' (64.0 GiB) is more than the device's total memory (23.0 GiB)" \
           in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="residency"):
        AutoOptions(device_budget="16GiB").resolve(free=FREE, total=23 * 2**30)
        AutoOptions(device_budget="64GiB").resolve(free=FREE, total=None)  # total unknown
    assert not caplog.records
