"""Checks shared by the task tests of ``federation.holdout: validation``."""

from __future__ import annotations

from medfed.data.federation import Federation


def assert_validation_carved_from_training(on_test: Federation, on_validation: Federation, noun: str) -> None:
    """Site by site: the validation run sets aside exactly the test run's test subjects and splits its training subjects.

    Args:
        on_test: the federation built with ``holdout: test`` (same data, seed and test fraction, no validation split).
        on_validation: the one built with ``holdout: validation``.
        noun: the subjects' name in ``SiteData.info`` (``cases``, ``series``, ``records``).
    """
    assert on_test.holdout == "test" and on_validation.holdout == "validation"
    for plain, held in zip(on_test.sites, on_validation.sites, strict=True):
        assert f"validation_{noun}" not in plain.info
        train, validation, test = (set(held.info[f"{split}_{noun}"]) for split in ("train", "validation", "test"))
        assert train and validation and test
        assert test == set(plain.info[f"test_{noun}"])  # the same test split, set aside
        assert test.isdisjoint(train | validation)  # (a) no test subject is used
        assert train.isdisjoint(validation)  # (b) split by subject ...
        assert train | validation == set(plain.info[f"train_{noun}"])  # ... of exactly the training subjects


def validation_subjects(federation: Federation, noun: str) -> list[list]:
    """Each site's validation subjects (to compare seeds)."""
    return [site.info[f"validation_{noun}"] for site in federation.sites]
