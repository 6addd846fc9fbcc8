"""Refusals raised by planning: the user must change the spec (or the catalog) to proceed."""

from __future__ import annotations

from davit_operator.api.status import IMAGE_RESOLVED, RUNNER_SELECTED


class PlanError(ValueError):
    """A spec the operator cannot turn into a plan.

    `field` is the spec path at fault (for example `engine.variant`), `value` the offending value,
    `reason` a CamelCase condition reason, and `condition` the domain condition that reports it
    (`ImageResolved`, `RunnerSelected`, or "" when only the kstatus conditions apply). The
    message says what would work instead.
    """

    def __init__(
        self, *, field: str, value: object, reason: str, condition: str, message: str
    ) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.reason = reason
        self.condition = condition
        self.message = message


def image_error(field: str, value: object, reason: str, message: str) -> PlanError:
    """A refusal reported on the ImageResolved condition."""
    return PlanError(
        field=field, value=value, reason=reason, condition=IMAGE_RESOLVED, message=message
    )


def runner_error(field: str, value: object, reason: str, message: str) -> PlanError:
    """A refusal reported on the RunnerSelected condition."""
    return PlanError(
        field=field, value=value, reason=reason, condition=RUNNER_SELECTED, message=message
    )
