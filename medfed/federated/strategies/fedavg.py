"""FedAvg (McMahan et al. 2017): one global model, sample-weighted averaging.

Every parameter is averaged (the personalisation split is ignored); sites
are evaluated with the global model delivered at the end of each round.
"""

from __future__ import annotations

from medfed.federated.aggregate import weighted_average
from medfed.federated.strategies.base import DELIVER, Payload, Strategy, num_samples


class FedAvg(Strategy):
    name = "fedavg"

    def server_setup(self, initial: Payload, replies: dict[int, Payload]) -> None:
        self.global_model = initial["all"].clone()

    def server_aggregate(self, phase: str, replies: dict[int, Payload]) -> None:
        self.global_model = weighted_average(
            [reply["all"] for reply in replies.values()], [float(reply["num_samples"]) for reply in replies.values()]
        )

    def server_deliver(self, site_index: int) -> Payload:
        return {"all": self.global_model}

    def server_state_dict(self) -> dict:
        return {"global_model": self.global_model}

    def load_server_state_dict(self, state: dict) -> None:
        self.global_model = state["global_model"]

    def site_receive(self, site, phase: str, payload: Payload) -> None:
        if phase == DELIVER:
            site.module.set_vector("all", payload["all"])

    def site_reply(self, site, phase: str) -> Payload:
        return {"all": site.module.get_vector("all"), "num_samples": num_samples(site)}
