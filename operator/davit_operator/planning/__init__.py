"""Pure planning: spec + catalog (+ node facts, model shapes) -> `plan.Plan`. No I/O.

`plan` assembles the pieces: `image` resolves the artifact, `capabilities` checks what the
release serves, `runner` picks V1 or V2, `args` writes the engine command line, `placement` the
pod's resources and node rules, `memory` sizes the KV cache; `errors` names the field at fault.
"""
