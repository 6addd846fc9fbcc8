"""`spec.routing`: the Gateway API Inference Extension's InferencePool in front of the engines.

With `routing.inferencePool` the operator creates an `InferencePool`
(`inference.networking.k8s.io/v1`) named after the service that selects its engine pods (both
rollout tracks) on the engines' port, handing endpoint choice to the endpoint picker named by
`endpointPickerRef`; with `httpRoute` also an `HTTPRoute` (`gateway.networking.k8s.io/v1`)
attached to a Gateway whose only backend is the pool.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from davit_operator.api.schema import CrdModel

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class EndpointPickerRef(CrdModel):
    """The endpoint picker (the inference extension's EPP) the gateway asks for an endpoint."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Name of the endpoint picker's Service in this namespace.",
    )
    port: int = Field(
        default=9002,
        ge=1,
        le=65535,
        description="The endpoint picker's gRPC port on that Service (the EPP's default 9002).",
    )
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        default="FailClose",
        description="What the gateway does when the picker does not answer: FailClose refuses "
        "the request, FailOpen picks an endpoint itself.",
    )


class ParentRef(CrdModel):
    """The Gateway the HTTPRoute attaches to."""

    name: str = Field(
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="Gateway name."
    )
    namespace: str | None = Field(
        default=None,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Gateway namespace; default: the InferenceService's.",
    )
    section_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="A listener of the Gateway; default: every listener that allows the route.",
    )


class HTTPRouteSpec(CrdModel):
    parent_ref: ParentRef = Field(description="The Gateway the route attaches to.")
    path_prefix: str = Field(
        default="/",
        max_length=1024,
        pattern=r"^/[A-Za-z0-9._~/-]*$",
        description="Requests whose path starts with this prefix go to the pool.",
    )


class InferencePoolSpec(CrdModel):
    endpoint_picker_ref: EndpointPickerRef = Field(
        description="The endpoint picker extension the pool's gateway consults."
    )
    http_route: HTTPRouteSpec | None = Field(
        default=None,
        description="Also create an HTTPRoute NAME whose backend is the pool; none when unset.",
    )


class RoutingSpec(CrdModel):
    inference_pool: InferencePoolSpec | None = Field(
        default=None,
        description="Create an InferencePool NAME selecting this service's engine pods (needs "
        "the Gateway API Inference Extension CRDs; a Routed condition says when they are "
        "missing).",
    )
