"""DP-SGD at each site: per-sample clipping, Gaussian noise and a privacy accountant (Opacus).

With ``privacy.dp`` on, every local optimiser step of every training plan
(and adapt step) at every site is a DP-SGD step (Abadi et al., CCS 2016)::

    g_i   = grad of l(w; x_i) over the step's trainable parameters      (per sample, Opacus's GradSampleModule)
    c_i   = min(1, C / (||g_i||_2 + 1e-6))                              (Opacus's flat clipping factor)
    grad <- grad + (sum_i (c_i - 1) g_i + sigma C xi) / B,   xi ~ N(0, I)

``grad`` is the gradient the step's loss gives (its data term is the mean
(1/B) sum_i g_i over the batch of B samples, so ``grad`` becomes
(sum_i c_i g_i + sigma C xi) / B plus whatever the loss adds that involves
no sample: a strategy's proximal or coupling term, a function of the
parameters and of what the server sent, which are themselves outputs of
earlier private steps, so adding their gradient unclipped is
post-processing and costs no privacy). With sigma = 0 and C = inf the
update is the non-private one, bit for bit (``grad + 0``).

*Sampling.* The batches are medfed's seeded, shuffled fixed-size batches of
each site's data order (so the data orders, resumption and the equal-compute
bookkeeping stay as without DP), not Poisson sampling: the accountant is told
the sampling rate q = B / n of a Poisson-sampled step, the usual
approximation (Opacus's own DataLoader without ``poisson_sampling`` makes the
same one); the guarantee is exact only under Poisson sampling.

*Noise.* Each :meth:`SiteDP.noise_generator` is seeded from (run seed, site,
the global-RNG stream of the work in progress: round and phase, and the
number of training calls before it in that stream), so the noise is
reproducible and a resumed run draws what an uninterrupted one draws
(``secure_mode`` is off: a seeded PRNG is not a cryptographic source; a
deployment that needs one would draw from ``torch.Generator`` seeded by the
OS, at the cost of reproducibility).

*Accounting.* One Opacus accountant per site (``rdp`` or ``prv``) counts the
site's DP steps (noise multiplier sigma, rate q); its history goes into the
site's checkpoint. With ``target_epsilon`` the noise multiplier is Opacus's
:func:`~opacus.accountants.utils.get_noise_multiplier` for the steps the site
plans over the run; a site whose next step would take it past the target
stops training (it still receives, replies with what it has, and is
evaluated), with a one-line note; ``on_budget: stop_run`` ends the run at
the end of that round instead.

Client-level DP (:class:`ClientDP`, ``privacy.client_dp``) protects a whole
site's data instead: what the site sends is clipped and noised at
aggregation (McMahan et al., ICLR 2018; Flower's
``DifferentialPrivacyServerSideFixedClipping``), see its docstring.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from medfed.config import MAX_NOISE_MULTIPLIER
from medfed.errors import ConfigError, RunFailed, warn
from medfed.federated.aggregate import weighted_average
from medfed.federated.protocol import NUM_SAMPLES, Payload, RoundContext

if TYPE_CHECKING:
    from medfed.config import ClientDPConfig, DPConfig

#: the stabiliser of Opacus's clipping factor C / (||g|| + 1e-6)
CLIP_EPSILON = 1e-6
#: the stream tag of the noise generators (beside the site's other draws from (seed, site, round, phase))
NOISE_STREAM = 0xD95
#: the stream tag of client-level DP's noise at aggregation (drawn from (seed, round, phase))
CLIENT_NOISE_STREAM = 0xC1D9


def dp_compatible(module: nn.Module) -> tuple[nn.Module, list[str]]:
    """``module`` with every layer DP-SGD cannot train replaced (Opacus's ``ModuleValidator.fix``: BatchNorm -> GroupNorm).

    The personalisation split is recomputed on the fixed module (GroupNorm
    keeps BatchNorm's parameter names; its running-statistics buffers are
    gone). Returns the fixed module (``module`` itself when nothing needed
    fixing) and one line per kind of replaced layer, for the results.
    """
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(module, strict=False)
    if not errors:
        return module, []
    replaced = sorted({type(m).__name__ for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
    fixed = ModuleValidator.fix(module)
    remaining = ModuleValidator.validate(fixed, strict=False)
    if remaining:
        raise ValueError(f"{type(module).__name__} cannot be trained with DP-SGD even after Opacus's fixes: {remaining[0]}")
    options = getattr(fixed, "options", None)
    fixed.configure_split(getattr(options, "personal_patterns", None), getattr(options, "shared_patterns", None))
    return fixed, [f"{name} -> GroupNorm (Opacus ModuleValidator.fix: BatchNorm mixes the samples of a batch)" for name in replaced]


def make_accountant(name: str) -> Any:
    """A fresh Opacus accountant: ``rdp`` (RDPAccountant) or ``prv`` (PRVAccountant)."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    return {"rdp": RDPAccountant, "prv": PRVAccountant}[name]()


def steps_within(
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    sample_rate: float,
    accountant: str,
    history: list | None = None,
    within: int = 0,
) -> int:
    """The most further DP steps (sigma, q) after ``history`` whose epsilon at ``delta`` stays <= ``target_epsilon``.

    ``within``: a count known to stay within it (e.g. the steps sigma was
    chosen for), where the search starts; one accountant evaluation when
    one more step would pass the target, a bisection otherwise.
    """

    def fits(steps: int) -> bool:
        return history_epsilon(accountant, (*(history or []), (noise_multiplier, sample_rate, steps)), delta) <= target_epsilon

    if within and not fits(within):
        within = 0
    low, high = within, within + 1
    while fits(high):
        low, high = high, 2 * high
        if high > 10**9:
            return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def accounted_epsilon(accountant: Any, noise_multiplier: float, delta: float) -> float:
    """The epsilon at ``delta`` an Opacus accountant gives for what it has recorded: 0 before any step, inf without noise."""
    if not accountant.history:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return history_epsilon(accountant.mechanism(), tuple(accountant.history), delta)


@functools.lru_cache(maxsize=4096)
def history_epsilon(accountant: str, history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Epsilon at ``delta`` of an accountant ``history`` of (sigma, q, steps) entries, as Opacus's ``get_epsilon`` gives it.

    Sites with the same (sigma, q) share one evaluation (cached). For ``rdp``
    the Renyi divergence of one step is computed once per (q, sigma) and the
    history's is sum_i steps_i * RDP_1(q_i, sigma_i) at Opacus's default
    orders, which is what ``RDPAccountant.get_privacy_spent`` sums (Opacus
    multiplies one step's RDP by the steps); so the value is Opacus's, to the
    bit (tested), while a round's epsilon no longer recomputes the fractional
    orders' series (about 0.3 s per site and round at q = 0.4).
    """
    with warnings.catch_warnings():  # far-off step counts probe orders at the edge of Opacus's range
        warnings.simplefilter("ignore", UserWarning)
        if accountant != "rdp":
            recorded = make_accountant(accountant)
            recorded.history = list(history)
            return float(recorded.get_epsilon(delta))
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis.rdp import get_privacy_spent

        rdp = sum(np.asarray(_rdp_of_one_step(q, sigma)) * steps for sigma, q, steps in history)
        return float(get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)[0])


@functools.lru_cache(maxsize=256)
def _rdp_of_one_step(sample_rate: float, noise_multiplier: float) -> tuple[float, ...]:
    """One subsampled Gaussian step's RDP at Opacus's default orders."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    return tuple(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))


@functools.lru_cache(maxsize=256)
def noise_multiplier_for(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """Opacus's ``get_noise_multiplier`` for ``steps`` steps at rate q; computed once for the sites that share (q, steps)
    (at q = 0.4 one search is about 20 s on one CPU core)."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # Opacus's search probes sigmas whose best RDP order is its largest
        warnings.simplefilter("ignore", UserWarning)
        return get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant,
        )


@dataclass
class SiteDP:
    """DP-SGD of one site: the mechanism's parameters, its accountant and its noise generators.

    Args:
        config: the run's ``privacy.dp`` group (on).
        site: the site's name (for notes).
        n_train: n, the site's training samples.
        batch_size: B; the sampling rate is q = min(1, B / n).
        planned_steps: the DP steps the site plans over the run (for ``target_epsilon``).
        seed: the run's seed; index: the site's index (the noise generators' seeds).
    """

    config: DPConfig
    site: str
    n_train: int
    batch_size: int
    planned_steps: int
    seed: int
    index: int

    def __post_init__(self) -> None:
        cfg = self.config
        self.sample_rate = min(1.0, self.batch_size / self.n_train)
        if cfg.target_epsilon is not None:
            planned = max(1, self.planned_steps)
            try:
                self.noise_multiplier = noise_multiplier_for(cfg.target_epsilon, cfg.delta, self.sample_rate, planned, cfg.accountant)
            except ValueError as error:  # the rdp floor is refused with the config; a prv target below what noise reaches
                raise ConfigError(
                    f"config key 'privacy.dp.target_epsilon' = {cfg.target_epsilon!r}: no noise multiplier up to "
                    f"{MAX_NOISE_MULTIPLIER:g} reaches it at {self.site} ({planned} steps at sampling rate {self.sample_rate:.3g}, "
                    f"delta {cfg.delta:g}, accountant {cfg.accountant}; Opacus: {error}); raise it"
                ) from None
            self.step_budget: int | None = steps_within(
                cfg.target_epsilon, cfg.delta, self.noise_multiplier, self.sample_rate, cfg.accountant, within=planned
            )
        else:
            self.noise_multiplier = float(cfg.noise_multiplier)
            self.step_budget = None
        self.max_grad_norm = float(cfg.max_grad_norm)
        self.accountant = make_accountant(cfg.accountant)
        self.steps = 0
        self.spent_note: str | None = None

    # ------------------------------------------------------------------ the mechanism
    def attach(self, modules: list[nn.Module]) -> list[Any]:
        """Opacus's per-sample-gradient hooks on the layers of ``modules`` that have trainable parameters now.

        Only the hooks are used: the modules are still called as before (by
        the strategy's loss), and each backward leaves ``p.grad_sample``
        (B, *shape) on the trainable parameters. The hooks are added for one
        training call (after the call's part is made trainable) and removed
        by :meth:`detach`: Opacus's hooks assume the trainable layers do not
        change while they are on, and a frozen layer between trainable ones
        would break their bookkeeping.
        """
        from lightning.fabric.wrappers import is_wrapped
        from opacus import GradSampleModule

        modules = [module.module if is_wrapped(module) else module for module in modules]  # the user's module behind Fabric's wrapper
        # Opacus's full backward hook on a first layer fires with no input gradient, which torch warns of at every step
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")
        return [GradSampleModule(module, batch_first=True, loss_reduction="mean", strict=True) for module in modules]

    @staticmethod
    def detach(hooked: list[Any]) -> None:
        """Remove the hooks :meth:`attach` added, with any per-sample gradients and activations they left."""
        for grad_sample_module in hooked:
            grad_sample_module.remove_hooks()
            for module in grad_sample_module._module.modules():
                if hasattr(module, "activations"):
                    del module.activations
            for p in grad_sample_module._module.parameters():
                p.grad_sample = None
                for name in ("_current_grad_sample", "_forward_counter"):
                    if hasattr(p, name):
                        delattr(p, name)

    @property
    def spent(self) -> bool:
        """Whether one more step would take the site past ``target_epsilon``."""
        return self.step_budget is not None and self.steps >= self.step_budget

    def noise_generator(self, device: torch.device, *stream: int) -> torch.Generator:
        """The generator of the noise of one training call, seeded from (seed, site, ``stream``)."""
        seed = int(np.random.SeedSequence([self.seed, self.index, NOISE_STREAM, *stream]).generate_state(1)[0])
        return torch.Generator(device=device).manual_seed(seed)

    def privatise(self, parameters: list[nn.Parameter], generator: torch.Generator) -> None:
        """Turn the step's gradients into DP-SGD's (module docstring), in place, and count the step.

        ``parameters``: the step's trainable parameters; those with a
        ``grad_sample`` (B, *shape) carry the data term. Clears the
        ``grad_sample``s.
        """
        sampled = [p for p in parameters if getattr(p, "grad_sample", None) is not None and p.grad is not None]
        if sampled:
            per_sample = [p.grad_sample for p in sampled]
            batch = per_sample[0].shape[0]
            norms = torch.stack([g.reshape(batch, -1).norm(2, dim=1) for g in per_sample], dim=1).norm(2, dim=1)  # (B,)
            excess = (self.max_grad_norm / (norms + CLIP_EPSILON)).clamp(max=1.0) - 1.0  # c_i - 1 <= 0, (B,)
            std = self.noise_multiplier * self.max_grad_norm
            for p, g in zip(sampled, per_sample):
                correction = torch.tensordot(excess.to(g.dtype), g, dims=1)
                if std > 0:
                    correction = correction + torch.normal(0.0, std, p.shape, generator=generator, device=p.device, dtype=p.dtype)
                p.grad.add_(correction / batch)
        for p in parameters:
            p.grad_sample = None
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.steps += 1

    def note_spent(self) -> None:
        """Warn once that the site stops training: its budget is spent."""
        if self.spent_note is None:
            self.spent_note = (
                f"site {self.site}: privacy budget epsilon={self.config.target_epsilon} (delta={self.config.delta}) "
                f"reached after {self.steps} DP-SGD steps; it trains no more"
            )
            warn(self.spent_note)

    # ------------------------------------------------------------------ accounting and state
    def epsilon(self) -> float:
        """The site's epsilon at ``delta`` after the steps so far (0 before any)."""
        return accounted_epsilon(self.accountant, self.noise_multiplier, self.config.delta)

    def record(self) -> dict[str, Any]:
        """What a round's record says of the site's privacy."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.config.delta,
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.max_grad_norm,
            "sample_rate": self.sample_rate,
            "accountant": self.config.accountant,
            "spent": self.spent,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "steps": self.steps, "spent_note": self.spent_note}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the step budget is what the target leaves after the restored history."""
        self.accountant.load_state_dict(state["accountant"])
        self.steps = int(state["steps"])
        self.spent_note = state["spent_note"]
        if self.step_budget is not None:
            cfg = self.config
            history = list(self.accountant.history)
            self.step_budget = self.steps + steps_within(cfg.target_epsilon, cfg.delta, self.noise_multiplier, self.sample_rate, cfg.accountant, history)


class PrivacyBudgetSpent(RunFailed):
    """A site's privacy budget ran out and ``privacy.dp.on_budget`` is ``stop_run``."""


class PrivacyRecord:
    """Fabric callback: after each round every site's privacy (:meth:`SiteDP.record`) joins the round's record as ``privacy``.

    With ``on_budget: stop_run`` a round in which a site's budget ran out
    ends the run (:class:`~medfed.errors.RunFailed`, one line), after the
    round is recorded.
    """

    def __init__(self, on_budget: str) -> None:
        self.on_budget = on_budget

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        sites = [site for site in loop.sites if site.privacy is not None]
        record["privacy"] = {site.name: site.privacy.record() for site in sites}
        spent = [site.privacy.spent_note for site in sites if site.privacy.spent_note]
        if spent and self.on_budget == "stop_run":
            raise PrivacyBudgetSpent(f"{spent[0]}; the run stops (privacy.dp.on_budget=stop_run)")


def privacy_summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json's ``privacy`` section: the last round's records (epsilon at delta after the run).

    ``dp_sgd``: each site's DP-SGD record; ``client_dp``: client-level DP's (:meth:`ClientDP.round_record`).
    """
    summary = {}
    for section, key in (("dp_sgd", "privacy"), ("client_dp", "client_dp")):
        last = next((record[key] for record in reversed(history) if key in record), None)
        if last is not None:
            summary[section] = last
    return summary




# ---------------------------------------------------------------------------- client-level DP at aggregation
def clip_update(update: dict[str, torch.Tensor], clipping_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """``update`` scaled by min(1, C / ||update||) (Flower's ``clip_inputs_inplace``, flat clipping), and its norm.

    ``update``: ``{key: (d_key,)}``, one update; its norm is the L2 norm of
    all keys' vectors together. Unchanged (the same tensors) when the norm
    is at most C.
    """
    norm = float(torch.sqrt(sum(vector.double().square().sum() for vector in update.values())))  # one host read per update
    if norm <= clipping_norm:
        return update, norm
    scale = clipping_norm / norm
    return {key: vector * scale for key, vector in update.items()}, norm


@dataclass
class ClientDP:
    """Client-level DP of what the sites send: each update clipped, Gaussian noise on their average (DP-FedAvg).

    McMahan, Ramage, Talwar and Zhang, "Learning differentially private
    recurrent language models", ICLR 2018, with Flower's server-side fixed
    clipping (``DifferentialPrivacyServerSideFixedClipping``). In every phase
    where the participants reply vectors, with m the sites sampled for the
    round and R of them replying (site k sent v_k and had been sent s_k)::

        Delta_k = v_k - s_k                                 (every vector key of the reply, flattened together)
        r_k     = s_k + Delta_k min(1, C / ||Delta_k||)     (unchanged when ||Delta_k|| <= C)
        release = (1/m) sum_{sampled k} r_k + N(0, (sigma C / m)^2 I)    (r_k = s_k for a sampled site that did not reply)

    The average is uniform over the sampled sites, with a fixed denominator m
    (McMahan's fixed-denominator estimator with equal weights): weighting by
    the sites' sample counts would let one site's count scale its share past
    C / m, so the counts are not used. The strategy's server step then
    receives ``release`` as the one reply of the phase (sample count 1): it
    sees no site's own vector, and whatever it computes from the release is
    post-processing. With sigma = 0 and C = inf, and every sampled site
    replying, the release is the uniform average of the replies, which is
    FedAvg's for sites of equal size (bit for bit).

    *Accounting.* Each release is one Gaussian mechanism of noise multiplier
    sigma on the sum of clipped updates (sensitivity C when a site is added
    or removed), subsampled at the participation rate q = m / n_sites: one
    step of Opacus's RDP accountant (q as a Poisson rate: the sites are a
    seeded draw of fixed size m, the same approximation DP-SGD's batches
    make). epsilon at ``delta`` after the releases so far is in every round's
    record.

    *Noise.* Drawn from a generator seeded from (run seed, round, phase), so
    a resumed run draws what an uninterrupted one does; the accountant's
    history is in the loop's checkpoint.

    Args:
        config: the run's ``privacy.client_dp`` group (on).
        seed: the run's seed.
    """

    config: ClientDPConfig
    seed: int

    def __post_init__(self) -> None:
        self.sample_rate: float | None = None  # q of the last release
        self.noise_multiplier = float(self.config.noise_multiplier)
        self.clipping_norm = float(self.config.clipping_norm)
        self.accountant = make_accountant("rdp")
        self.releases = 0
        self._round: dict[str, Any] = {}  # the current round's clipping and noise, for its record

    def noise_seed(self, round_index: int, phase_index: int) -> int:
        """The seed of the noise of one release, derived from (run seed, round, phase) (in the round's record)."""
        return int(np.random.SeedSequence([self.seed, CLIENT_NOISE_STREAM, round_index, phase_index]).generate_state(1)[0])

    def release(
        self, ctx: RoundContext, phase_index: int, replies: dict[int, Payload], sent: dict[int, Payload], sampled: list[int], sample_rate: float
    ) -> dict[int, Payload]:
        """The phase's replies turned into the one noised average the server step receives (class docstring).

        Args:
            ctx: the phase's context; phase_index: its rank in the round (the noise's stream).
            replies: ``{site index: reply}``, the replies the server accepted (not empty).
            sent: ``{site index: {key: vector}}``, what the server last sent each sampled site (its
                delivery, overridden by the phase's message).
            sampled: the sites sampled for the round (m = len(sampled)).
            sample_rate: q, the rate the round's sites were drawn at (for the accountant).

        Returns:
            ``{the first replying site: {key: release, "num_samples": 1}}``, or ``replies`` unchanged
            when they carry no vector (nothing is released, nothing is counted).

        Raises:
            RunFailed: a reply's vector the server sent no counterpart of (the strategy declares
                client-level DP wrongly).
        """
        first = min(replies)
        keys = sorted(key for key in replies[first] if key != NUM_SAMPLES)
        if not keys:
            return replies
        for index in sampled:
            missing = [key for key in keys if key not in sent[index] or sent[index][key].shape != replies[first][key].shape]
            if missing:
                raise RunFailed(
                    f"privacy.client_dp: the server sent site {index} no {missing[0]!r} vector in round {ctx.round} to measure its "
                    "update against (the strategy cannot take client-level DP)"
                )
        rows, norms = [], []  # r_k of every sampled site, ||Delta_k|| of every reply
        for index in sampled:
            reference = sent[index]
            if index not in replies:  # sampled, did not reply: a zero update
                rows.append({key: reference[key] for key in keys})
                continue
            reply = replies[index]
            update = {key: reply[key] - reference[key] for key in keys}
            clipped, norm = clip_update(update, self.clipping_norm)
            norms.append(norm)
            rows.append({key: reply[key] for key in keys} if clipped is update else {key: reference[key] + clipped[key] for key in keys})
        m = len(sampled)
        released = {key: weighted_average([row[key] for row in rows], [1.0] * m) for key in keys}
        std = self.noise_multiplier * self.clipping_norm / m
        noise_seed = self.noise_seed(ctx.round, phase_index)
        if std > 0:
            generator = torch.Generator(device=released[keys[0]].device).manual_seed(noise_seed)
            for key in keys:  # sorted: the same draws in the same order on resume
                vector = released[key]
                released[key] = vector + torch.normal(0.0, std, vector.shape, generator=generator, device=vector.device, dtype=vector.dtype)
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=sample_rate)
        self.releases += 1
        self.sample_rate = sample_rate
        self._round = {
            "noise_std": std,
            "noise_seed": noise_seed,
            "sampled": m,
            "replied": len(replies),
            "clipped": sum(norm > self.clipping_norm for norm in norms),
            "median_update_norm": float(np.median(norms)),
        }
        count = torch.ones(1, dtype=replies[first][NUM_SAMPLES].dtype, device=replies[first][NUM_SAMPLES].device)
        return {first: {**released, NUM_SAMPLES: count}}

    def epsilon(self) -> float:
        """epsilon at ``delta`` after the releases so far (0 before any, inf without noise)."""
        return accounted_epsilon(self.accountant, self.noise_multiplier, self.config.delta)

    def round_record(self) -> dict[str, Any]:
        """What a round's record says of client-level DP: epsilon so far, and the round's last release (then forgotten)."""
        record = {
            "epsilon": self.epsilon(),
            "delta": self.config.delta,
            "releases": self.releases,
            "noise_multiplier": self.noise_multiplier,
            "clipping_norm": self.clipping_norm,
            "sample_rate": self.sample_rate,
            "accountant": "rdp",
            **self._round,
        }
        self._round = {}
        return record

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "releases": self.releases, "sample_rate": self.sample_rate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self.releases = int(state["releases"])
        self.sample_rate = state["sample_rate"]

