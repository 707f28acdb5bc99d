"""sites_at_label_ratio: what each site keeps and drops per split, reported in info, a log line and a warning."""

import logging

import numpy as np
import pytest

from medfed.config import LabelRatioConfig
from medfed.errors import ConfigError
from medfed.tasks.label_imbalance import sites_at_label_ratio

# Two sites; every ratio is 1 (spread 1), so a site keeps min(P, N) positives and as many negatives per split.
#            site 0: train 2 positive + 8 negative, test 1 + 3;  site 1: train 4 + 5, test 2 + 2, and one
#            set-aside negative (in neither split, so neither kept nor dropped).
LABELS = [1] * 2 + [0] * 8 + [1] * 1 + [0] * 3 + [1] * 4 + [0] * 5 + [1] * 2 + [0] * 2 + [0]
SITES = [0] * 14 + [1] * 14
IN_TEST = [False] * 10 + [True] * 4 + [False] * 9 + [True] * 4 + [True]
SET_ASIDE = [False] * 27 + [True]
# By hand: site 0 keeps train 2 + 2 of 10 (drops 6), test 1 + 1 of 4 (drops 2): 8 of its 14 dropped, more than half;
#          site 1 keeps train 4 + 4 of 9 (drops 1), test 2 + 2 of 4 (drops 0).
EXPECTED_DROPPED = [{"n_train_dropped": 6, "n_test_dropped": 2}, {"n_train_dropped": 1, "n_test_dropped": 0}]


def build(label_ratio):
    return sites_at_label_ratio(
        np.array(LABELS), np.array(SITES), np.array(IN_TEST), n_sites=2, label_ratio=label_ratio, seed=0,
        source="records.csv", set_aside=np.array(SET_ASIDE), noun="records",
    )


def test_drops_per_site_and_split_are_in_info_logged_once_and_a_site_losing_most_is_warned_about(caplog):
    caplog.set_level(logging.INFO, logger="medfed")
    sites = build(LabelRatioConfig(delta=1.0, spread=1.0))
    for site, expected in zip(sites, EXPECTED_DROPPED):
        assert {key: site.info[key] for key in expected} == expected
    assert [(len(site.train), len(site.test)) for site in sites] == [(4, 2), (8, 4)]
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        ("INFO", "federation.label_ratio (delta 1, spread 1) kept 18 of 27 records: "
                 "site0 train 4 of 10, test 2 of 4; site1 train 8 of 9, test 4 of 4"),
        ("WARNING", "federation.label_ratio (delta 1, spread 1) drops more than half of the records of "
                    "site0 (8 of 14 dropped, its own ratio 3.67): set federation.label_ratio.delta nearer the "
                    "sites' own ratios, federation.label_ratio=null to keep all records, or "
                    "federation.label_ratio.max_drop above the share dropped if it is what you mean"),
    ]


def test_without_a_label_ratio_nothing_is_dropped_or_reported(caplog):
    caplog.set_level(logging.INFO, logger="medfed")
    sites = build(None)
    assert [(len(site.train), len(site.test)) for site in sites] == [(10, 4), (9, 4)]
    assert all(site.info["n_train_dropped"] == site.info["n_test_dropped"] == 0 for site in sites)
    assert caplog.records == []


def test_no_warning_when_every_site_keeps_at_least_half(caplog):
    caplog.set_level(logging.INFO, logger="medfed")
    sites = build(LabelRatioConfig(delta=2.0, spread=1.0))
    # by hand, p positives and 2p negatives per split: site 0 keeps train 2 + 4 of 10, test 1 + 2 of 4 (5 of 14
    # dropped); site 1 keeps train 2 + 4 of 9, test 1 + 2 of 4 (4 of 13 dropped)
    assert [(site.info["n_train_dropped"], site.info["n_test_dropped"]) for site in sites] == [(4, 1), (3, 1)]
    assert [record.levelname for record in caplog.records] == ["INFO"]


def test_a_max_drop_above_the_share_a_site_loses_silences_the_warning_and_a_lower_one_names_more_sites(caplog):
    caplog.set_level(logging.INFO, logger="medfed")
    build(LabelRatioConfig(delta=1.0, spread=1.0, max_drop=0.6))  # site 0 loses 8 of 14 (57%)
    assert [record.levelname for record in caplog.records] == ["INFO"]
    caplog.clear()
    build(LabelRatioConfig(delta=1.0, spread=1.0, max_drop=0.1))  # site 1 loses 1 of 13 (8%): still not named
    assert caplog.records[-1].getMessage().startswith(
        "federation.label_ratio (delta 1, spread 1) drops more than 10% of the records of site0 (8 of 14 dropped"
    )
    assert "site1" not in caplog.records[-1].getMessage()
    caplog.clear()
    build(LabelRatioConfig(delta=1.0, spread=1.0, max_drop=0.05))
    assert "site1 (1 of 13 dropped" in caplog.records[-1].getMessage()


def test_max_drop_is_a_share():
    with pytest.raises(ConfigError, match=r"federation\.label_ratio\.max_drop"):
        LabelRatioConfig(max_drop=1.5)
