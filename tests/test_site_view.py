"""SiteView and RoundContext: what a strategy's site half sees of its site, and when."""

import ast
from pathlib import Path

import torch

import medfed
from medfed.federated.site import Site, View
from medfed.federated.protocol import RoundContext, TrainingPlan
from medfed.federated.strategies.base import SiteHalf, Strategy
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation


class _Recording(Strategy):
    """Two phases, one step each; its site halves record every hook's context and what they were given."""

    name = "recording"
    phases = ("first", "second")
    calls: list = []

    class Site(SiteHalf):
        def _record(self, hook, site, ctx):
            _Recording.calls.append((self.index, hook, ctx, site))

        def setup(self, site, ctx):
            self._record("setup", site, ctx)
            return {}

        def receive(self, site, ctx, payload):
            self._record("receive", site, ctx)

        def deliver(self, site, ctx, payload):
            self._record("deliver", site, ctx)

        def plan(self, ctx):
            self._record("plan", None, ctx)
            return (TrainingPlan(steps=1),)

        def loss(self, site, ctx, plan, batch):
            self._record("loss", site, ctx)
            return super().loss(site, ctx, plan, batch)

        def reply(self, site, ctx):
            self._record("reply", site, ctx)
            return {}


def test_every_site_hook_gets_the_sites_view_and_the_round_and_phase_it_runs_in():
    _Recording.calls = []
    loop = build_loop(_Recording, two_group_federation(n_sites=2), seeded(LinearClassifier, 4, 2))
    loop.fit(2)
    site0 = [(hook, ctx) for index, hook, ctx, _ in _Recording.calls if index == 0]
    expected = [("setup", RoundContext(0, "setup")), ("deliver", RoundContext(0, "deliver"))]
    for r in (1, 2):
        for phase in ("first", "second"):
            expected += [(hook, RoundContext(r, phase)) for hook in ("receive", "plan", "loss", "reply")]
        expected.append(("deliver", RoundContext(r, "deliver")))
    assert site0 == expected
    views = {site for index, _, _, site in _Recording.calls if index == 0 and site is not None}
    assert views == {loop.sites[0].view} and isinstance(loop.sites[0].view, View)
    for internal in ("slot", "slots", "fabric", "train", "optimizer", "strategy", "train_loader"):
        assert not hasattr(loop.sites[0].view, internal), internal  # the half sees no loader, optimiser or Fabric
    assert not isinstance(loop.sites[0].view, Site)


def test_the_view_gets_and_sets_parts_and_a_full_pass_is_in_order_counted_and_leaves_the_generators_alone():
    loop = build_loop("local", two_group_federation(n_sites=2, n_train=37), seeded(LinearClassifier, 4, 2), batch_size=8)
    site = loop.sites[0]
    view = site.view
    vector = torch.arange(8.0)
    view.set("model", "shared", vector)
    assert torch.equal(view.get("model", "shared"), vector) and torch.equal(site.module.get_vector("shared"), vector)
    generator, global_state = site.orders.generator.get_state(), torch.get_rng_state()
    batches = list(view.full_pass("train", "check", backward=False))
    assert [size for _, size in batches] == [8, 8, 8, 8, 5]
    assert torch.equal(torch.cat([x for (x, _), _ in batches]), site.data.train.tensors[0])  # the split, in order
    assert torch.equal(site.orders.generator.get_state(), generator) and torch.equal(torch.get_rng_state(), global_state)
    assert site.passes.take(site.n_train) == {"forward/check": 1.0}


def test_a_view_step_steps_the_slots_optimiser_once_frees_the_gradients_and_may_be_stopped():
    loop = build_loop("local", two_group_federation(n_sites=2, n_train=37), seeded(LinearClassifier, 4, 2), batch_size=8)
    site = loop.sites[0]
    view, module = site.view, site.module
    batch = next(iter(view.full_pass("train", "batch", backward=False)))[0]
    site.passes.take(site.n_train)
    before = view.get("model", "all")
    assert not view.step("model", module.training_step(batch, 0), batch, stop_if=lambda: True)
    assert torch.equal(view.get("model", "all"), before) and all(p.grad is None for p in module.parameters())
    loss = module.training_step(batch, 0)
    (gradient,) = torch.autograd.grad(loss, [module.linear.weight], retain_graph=True)
    assert view.step("model", loss, batch)
    lr = view.learning_rate("model")
    torch.testing.assert_close(module.linear.weight.detach(), before[:8].reshape(2, 4) - lr * gradient)
    assert all(p.grad is None for p in module.parameters())
    assert site.passes.take(site.n_train) == {"aux/step": 16 / 37}  # two backward passes of 8 samples, outside any plan


def _imports(module_path):
    """The medfed modules a source file imports, TYPE_CHECKING blocks included."""
    tree = ast.parse(Path(module_path).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_strategies_never_import_the_site_and_the_contract_imports_neither_side():
    root = Path(medfed.__file__).parent / "federated"
    for path in [root / "protocol.py", *sorted((root / "strategies").glob("*.py"))]:
        imported = _imports(path)
        assert "medfed.federated.site" not in imported, path.name
        if path.name == "protocol.py":
            assert not any(name.startswith("medfed.federated.strategies") for name in imported)
