"""The operator's two webhook configurations, written by the leader (kopf's managed mode gives every
webhook a 30 s timeout and no namespace selector, so a dead operator node could stall every pod creation in
the cluster for 30 s each):

- ValidatingWebhookConfiguration `ibckpt.io`, webhook `eviction`: pod evictions (drains, docs/drains.md);
- MutatingWebhookConfiguration `ibckpt.io`, webhook `restore-binding`: pod creations (restores whose pods
  a controller creates, cluster/bindings.py).

Both fail open (`Ignore`: the PodDisruptionBudgets still hold drains), time out fast, and skip the
namespaces labelled `ibckpt.io/admission=off` (kube-system, say). A clean exit empties both lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from ibckpt_operator.cluster.kube import Body, Kube

CONFIGURATION = "ibckpt.io"
EVICTION = "eviction"  # the kopf handler ids: their paths on the admission server
RESTORE_BINDING = "restore-binding"
OFF_LABEL = "ibckpt.io/admission"
BASE = "/apis/admissionregistration.k8s.io/v1"
VALIDATING, MUTATING = "validatingwebhookconfigurations", "mutatingwebhookconfigurations"


@dataclass(frozen=True)
class Endpoint:
    """Where the apiserver calls the leader's admission server, and the CA its certificate chains to."""

    url: str  # https://HOST:PORT
    ca_bundle: str  # base64 of the PEM
    eviction_timeout_s: int = 10
    creation_timeout_s: int = 5


def _webhook(endpoint: Endpoint, handler: str, resource: str, timeout_s: int) -> Body:
    return {
        "name": f"{handler}.{CONFIGURATION}",
        "clientConfig": {"url": f"{endpoint.url.rstrip('/')}/{handler}", "caBundle": endpoint.ca_bundle},
        "rules": [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": [resource],
                "operations": ["CREATE"],
                "scope": "Namespaced",
            }
        ],
        "namespaceSelector": {
            "matchExpressions": [{"key": OFF_LABEL, "operator": "NotIn", "values": ["off"]}]
        },
        "failurePolicy": "Ignore",
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": timeout_s,
        "admissionReviewVersions": ["v1", "v1beta1"],
    }


def configurations(endpoint: Endpoint) -> dict[str, Body]:
    """Both configurations' bodies, by plural."""
    eviction = _webhook(endpoint, EVICTION, "pods/eviction", endpoint.eviction_timeout_s)
    binding = _webhook(endpoint, RESTORE_BINDING, "pods", endpoint.creation_timeout_s)
    binding["reinvocationPolicy"] = "Never"
    return {
        plural: {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind,
            "metadata": {"name": CONFIGURATION},
            "webhooks": [hook],
        }
        for plural, kind, hook in (
            (VALIDATING, "ValidatingWebhookConfiguration", eviction),
            (MUTATING, "MutatingWebhookConfiguration", binding),
        )
    }


async def publish(kube: Kube, endpoint: Endpoint) -> None:
    """Create both configurations, or replace what is there (an earlier leader's address)."""
    for plural, body in configurations(endpoint).items():
        path = f"{BASE}/{plural}/{CONFIGURATION}"
        existing = await kube.request("GET", path)
        if existing is None:
            await kube.request("POST", f"{BASE}/{plural}", body)
            continue
        body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
        await kube.request("PUT", path, body)


async def withdraw(kube: Kube) -> None:
    """Empty both lists at a clean exit: nothing calls a stopped operator until the next leader writes."""
    for plural in (VALIDATING, MUTATING):
        patch: Body = {"webhooks": []}
        await kube.request("PATCH", f"{BASE}/{plural}/{CONFIGURATION}", patch, "application/merge-patch+json")
