import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import TensorDataset

from medfed.config import parse_options
from medfed.data.federation import SiteData
from medfed.errors import ConfigError, DataError
from medfed.federated.site import Site, Slot
from medfed.federated.strategies.base import SiteHalf
from medfed.models.classification import NoduleClassifier
from medfed.models.tabular import LogisticRegression

TINY_DENSENET = NoduleClassifier.Options(init_features=4, growth_rate=4, block_config=[2, 2])

# A fixed test set given as log-odds of the positive class, and its labels.
LOG_ODDS = [-2.0, -1.0, 0.5, 1.0, -0.5, -3.0, 2.0, 0.1]
LABELS = [0, 0, 0, 1, 1, 0, 1, 0]
# By hand: predicted 1 iff log-odds > 0 -> [0, 0, 1, 1, 0, 0, 1, 1];
# TN = 3 (items 0, 1, 5), FP = 2 (items 2, 7), TP = 2 (items 3, 6), FN = 1 (item 4).
HAND_ACCURACY = 5 / 8
HAND_BALANCED_ACCURACY = (3 / 5 + 2 / 3) / 2
# positives score 1, -0.5, 2; of the 5 negatives they beat 5, 3 and 5 -> 13 of 15 pairs.
HAND_AUROC = 13 / 15


def identity_logistic_regression() -> LogisticRegression:
    """One feature, w = 1, b = 0: the log-odds are the input itself."""
    model = LogisticRegression(1, 2)
    model.set_vector("all", torch.tensor([1.0, 0.0]))
    return model


def evaluate(model, batches):
    for index, (x, y) in enumerate(batches):
        model.test_step((x, y), index)
    return model.test_results()


def test_metrics_match_a_hand_computation_in_one_batch_and_in_several():
    x, y = torch.tensor(LOG_ODDS).reshape(-1, 1), torch.tensor(LABELS)
    pairs = [(p, n) for p, n in itertools.product(x[y == 1, 0], x[y == 0, 0])]
    assert HAND_AUROC == pytest.approx(sum(float(p > n) for p, n in pairs) / len(pairs))  # brute-force reference

    model = identity_logistic_regression()
    one_batch = evaluate(model, [(x, y)])
    several = evaluate(model, [(x[:3], y[:3]), (x[3:6], y[3:6]), (x[6:], y[6:])])
    assert list(one_batch) == ["accuracy", "balanced_accuracy", "auroc"]
    for results in (one_batch, several):
        assert results["accuracy"] == pytest.approx(HAND_ACCURACY)
        assert results["balanced_accuracy"] == pytest.approx(HAND_BALANCED_ACCURACY)
        assert results["auroc"] == pytest.approx(HAND_AUROC, abs=1e-6)


def test_results_reset_between_evaluations():
    model = identity_logistic_regression()
    evaluate(model, [(torch.tensor([[5.0], [-5.0]]), torch.tensor([0, 1]))])  # all wrong
    x, y = torch.tensor(LOG_ODDS).reshape(-1, 1), torch.tensor(LABELS)
    assert evaluate(model, [(x, y)])["accuracy"] == pytest.approx(HAND_ACCURACY)


def test_a_constant_majority_prediction_has_balanced_accuracy_one_half():
    model = identity_logistic_regression()
    labels = torch.tensor([0] * 9 + [1])
    results = evaluate(model, [(torch.full((10, 1), -1.0), labels)])
    assert results["accuracy"] == pytest.approx(0.9)
    assert results["balanced_accuracy"] == pytest.approx(0.5)
    assert results["auroc"] == pytest.approx(0.5)


def test_densenet_loss_is_two_class_cross_entropy_and_lr_loss_is_binary_cross_entropy():
    torch.manual_seed(0)
    densenet = NoduleClassifier(1, 2, TINY_DENSENET).eval()
    x, y = torch.randn(6, 1, 32, 32), torch.tensor([0, 1, 1, 0, 0, 1])
    assert densenet.training_step((x, y), 0).item() == pytest.approx(F.cross_entropy(densenet(x), y).item(), rel=1e-5)

    logreg = LogisticRegression(3, 2)
    features = torch.randn(6, 3)
    p = torch.sigmoid(features @ logreg.linear.weight[0] + logreg.linear.bias)
    by_hand = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
    assert logreg.training_step((features, y), 0).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_densenet_default_split_classifier_personal_features_shared():
    model = NoduleClassifier(1, 2, TINY_DENSENET)
    split = model.parameter_split
    assert split.personal == ("densenet.class_layers.out.weight", "densenet.class_layers.out.bias")
    assert split.shared and all(name.startswith("densenet.features.") for name in split.shared)
    assert split.size("shared") + split.size("personal") == sum(p.numel() for p in model.parameters())
    assert model.get_parameter("densenet.class_layers.out.weight").shape[0] == 2


def test_logistic_regression_default_split_is_all_personal():
    model = LogisticRegression(5, 2)
    split = model.parameter_split
    assert split.shared == () and split.personal == ("linear.weight", "linear.bias")
    assert model.get_vector("shared").shape == (0,) and model.get_vector("personal").shape == (6,)
    assert model(torch.zeros(4, 5)).shape == (4,)


def test_default_densenet_keeps_a_feature_map_on_32x32_patches():
    model = NoduleClassifier(1, 2).eval()
    features = model.densenet.features(torch.zeros(2, 1, 32, 32))
    assert features.shape[-2:] == (2, 2)  # 32 / 4 (stem) / 2 / 2 (two transitions)
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 2)


@pytest.mark.parametrize("blocks", [[1], [1, 1], [1, 1, 1]])
def test_min_input_side_matches_brute_force(blocks):
    model = NoduleClassifier(1, 2, NoduleClassifier.Options(init_features=2, growth_rate=2, block_config=blocks)).eval()
    runs = []
    for side in range(1, 21):
        try:
            model.densenet(torch.zeros(1, 1, side, side))  # the raw network, without medfed's check
            runs.append(side)
        except RuntimeError:
            pass
    assert runs == list(range(model.min_input_side(), 21))
    if model.min_input_side() > 1:
        with pytest.raises(ValueError, match="at least"):
            model(torch.zeros(1, 1, model.min_input_side() - 1, 32))


def test_two_class_models_refuse_other_class_counts():
    with pytest.raises(ValueError, match="two-class"):
        LogisticRegression(3, 3)
    with pytest.raises(ValueError, match="two-class"):
        NoduleClassifier(1, 5, TINY_DENSENET)


def site_data(train_labels, name="site3"):
    """A site whose training labels are ``train_labels`` (features all zero; only the labels matter here)."""
    labels = torch.tensor(train_labels)
    return SiteData(name, TensorDataset(torch.zeros(len(labels), 1), labels), TensorDataset(torch.zeros(1, 1), labels[:1]))


def test_balanced_weights_come_from_the_sites_training_labels_and_weigh_the_loss_as_by_hand():
    model = LogisticRegression(1, 2, LogisticRegression.Options(class_weight="balanced"))
    model.set_vector("all", torch.tensor([1.0, 0.0]))  # log-odds = x
    model.prepare_for_site(site_data([0] * 6 + [1] * 2))
    assert model.class_weights == (8 / 12, 8 / 4)  # n / (2 n_c): 8 / (2 * 6), 8 / (2 * 2)
    x, y = torch.tensor([[0.5], [-1.0], [2.0], [0.3]]), torch.tensor([0, 1, 0, 1])
    # by hand: a negative with log-odds z costs log(1 + e^z), a positive log(1 + e^-z)
    by_hand = (2 / 3 * math.log(1 + math.exp(0.5)) + 2 * math.log(1 + math.exp(1.0))
               + 2 / 3 * math.log(1 + math.exp(2.0)) + 2 * math.log(1 + math.exp(-0.3))) / 4
    assert model.training_step((x, y), 0).item() == pytest.approx(by_hand, rel=1e-6)

    unweighted = identity_logistic_regression()
    unweighted.prepare_for_site(site_data([0] * 6 + [1] * 2))
    assert unweighted.class_weights is None
    by_hand = (math.log(1 + math.exp(0.5)) + math.log(1 + math.exp(1.0))
               + math.log(1 + math.exp(2.0)) + math.log(1 + math.exp(-0.3))) / 4
    assert unweighted.training_step((x, y), 0).item() == pytest.approx(by_hand, rel=1e-6)


def test_densenet_balanced_loss_is_the_class_weighted_two_class_cross_entropy():
    torch.manual_seed(0)
    densenet = NoduleClassifier(1, 2, dataclasses.replace(TINY_DENSENET, class_weight="balanced")).eval()
    densenet.prepare_for_site(site_data([0, 0, 0, 1]))  # weights 4/6 and 4/2
    x, y = torch.randn(3, 1, 32, 32), torch.tensor([0, 1, 1])
    by_hand = (F.cross_entropy(densenet(x), y, reduction="none") * torch.tensor([2 / 3, 2.0, 2.0])).mean()
    assert densenet.training_step((x, y), 0).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_class_weight_values_and_a_single_class_training_split_are_refused_by_name():
    assert parse_options(LogisticRegression.Options, {"class_weight": None}, "model").class_weight is None
    with pytest.raises(ConfigError, match="config key 'model.class_weight' = 'inverse': expected null or balanced"):
        parse_options(LogisticRegression.Options, {"class_weight": "inverse"}, "model")
    model = LogisticRegression(1, 2, LogisticRegression.Options(class_weight="balanced"))
    with pytest.raises(DataError, match="^site3: model.class_weight=balanced needs training samples of both classes, "
                                        "found 5 negative and 0 positive$"):
        model.prepare_for_site(site_data([0] * 5))


def imbalanced_split(n, seed):
    """n records, about 6% positive, two features; positives shifted by 1 standard deviation."""
    generator = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=generator) < 0.06).long()
    return TensorDataset(torch.randn(n, 2, generator=generator) + y[:, None].float(), y)


@pytest.mark.parametrize("class_weight", [None, "balanced"])
def test_balanced_weights_stop_a_site_with_6_percent_positives_calling_everything_negative(class_weight):
    data = SiteData("site0", imbalanced_split(400, 0), imbalanced_split(400, 1))
    assert int(data.train.tensors[1].sum()) == 22 and int(data.test.tensors[1].sum()) == 18
    torch.manual_seed(0)
    model = LogisticRegression(2, 2, LogisticRegression.Options(class_weight=class_weight))
    fabric = Fabric(accelerator="cpu", devices=1)
    slot = Slot(*fabric.setup(model, model.configure_optimizers()))
    site = Site(0, data, {"model": slot}, "model", SiteHalf(None, model.parameter_split, 1, 0, 0), fabric, batch_size=16, seed=0)
    site.train(site.steps(3.0), "model", "all", lambda batch: slot.module.training_step(batch, 0))  # the site handed its data to the model
    results = site.evaluate()
    if class_weight is None:  # every test record called negative: the accuracy is the share of negatives
        assert model.class_weights is None
        assert results["balanced_accuracy"] == 0.5 and results["accuracy"] == pytest.approx(382 / 400)
    else:
        assert model.class_weights == pytest.approx((400 / (2 * 378), 400 / (2 * 22)))
        assert results["balanced_accuracy"] > 0.75
