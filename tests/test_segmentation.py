"""The U-Net segmenter's two targets: whole tumour (softmax) and the BraTS regions (sigmoid per region)."""

import pytest
import torch

from medfed.models.segmentation import UNetSegmenter

TINY = {"channels": [4, 8], "strides": [2], "num_res_units": 0}


def test_region_masks_of_each_target():
    wt = UNetSegmenter(4, 2, UNetSegmenter.Options(**TINY))
    logits = torch.tensor([[[[2.0, -1.0]], [[1.0, 3.0]]]], device="cpu")  # (1, 2, 1, 2): pixel 1 is tumour
    assert wt.region_names == ("wt",) and wt.region_masks(logits).tolist() == [[[[False, True]]]]
    regions = UNetSegmenter(4, 3, UNetSegmenter.Options(**TINY), regions="brats")
    outputs = torch.tensor([[[[1.0]], [[-0.5]], [[0.2]]]], device="cpu")  # (1, 3, 1, 1)
    assert regions.region_names == ("wt", "tc", "et") and regions.region_masks(outputs).flatten().tolist() == [True, False, True]
    with pytest.raises(ValueError, match="needs 3 outputs"):
        UNetSegmenter(4, 2, UNetSegmenter.Options(**TINY), regions="brats")


def test_regions_train_on_masks_and_report_one_iou_per_region():
    torch.manual_seed(0)
    model = UNetSegmenter(4, 3, UNetSegmenter.Options(**TINY), regions="brats")
    x = torch.randn(2, 4, 16, 16, device="cpu")
    y = torch.zeros(2, 3, 16, 16, dtype=torch.uint8, device="cpu")
    y[:, 0, 4:12, 4:12] = 1
    y[:, 1, 6:10, 6:10] = 1
    loss = model.training_step((x, y), 0)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss) and model.unet.model[0].conv.weight.grad is not None
    with torch.no_grad():
        model.test_step((x, y), 0)
    predicted = model.region_masks(model(x)).long()
    expected = [((predicted[:, r] & y[:, r].long()).sum() / (predicted[:, r] | y[:, r].long()).sum()).item() for r in range(3)]
    results = model.test_results()
    assert list(results) == ["label_iou", "label_iou_tc", "label_iou_et"]
    assert results["label_iou"] == pytest.approx(expected[0]) and results["label_iou_tc"] == pytest.approx(expected[1])


def test_the_region_loss_rewards_nested_regions_predicted_together():
    """Where a pixel is in all three regions, all three outputs high is right: no softmax across the regions."""
    model = UNetSegmenter(4, 3, UNetSegmenter.Options(**TINY), regions="brats")
    masks = torch.zeros(1, 3, 8, 8, device="cpu")
    masks[:, :, 2:6, 2:6] = 1.0  # WT = TC = ET here
    perfect = torch.where(masks > 0, 20.0, -20.0)
    assert float(model.loss(perfect, masks)) < 1e-3
    expected = torch.nn.functional.binary_cross_entropy_with_logits(torch.zeros_like(masks), masks)  # undecided logits
    dice = 1 - (2 * (0.5 * masks).sum((2, 3)) / (0.5 * 64 + masks.sum((2, 3)))).mean()  # MONAI's Dice at sigmoid 0.5
    assert float(model.loss(torch.zeros_like(masks), masks)) == pytest.approx(float(expected + dice), rel=1e-4)


def test_dice_cross_entropy_is_monais_dice_ce_and_runs_under_vmap():
    from monai.losses import DiceCELoss

    from medfed.models.segmentation import DiceCrossEntropy

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 2, 8, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 2, (3, 4, 8, 8), generator=generator)
    ours, monais = DiceCrossEntropy(), DiceCELoss(to_onehot_y=True, softmax=True)
    for i in range(3):  # value for value, gradient for gradient: the default runs' numbers do not move
        a, b = ours(logits[i], labels[i]), monais(logits[i], labels[i].unsqueeze(1))
        assert torch.equal(a, b)
        assert torch.equal(torch.autograd.grad(a, logits)[0], torch.autograd.grad(b, logits)[0])
    stacked = torch.func.vmap(ours)(logits, labels)  # MONAI's one-hot scatter_ cannot run under vmap
    torch.testing.assert_close(stacked, torch.stack([ours(logits[i], labels[i]) for i in range(3)]))
