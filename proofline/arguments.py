"""A publish's arguments against the tool's input schema, as pinned (``proofline contracts pin``).

The worker calls the tool with exactly the arguments the approval signed; a server that refuses
them (a required argument missing, a wrong type) answers with a tool error the contract may read as
"failed before side effect", and the action is retried until it escalates. Checking the arguments
at publish, against the schema the reviewer pinned, refuses such an action before it is signed or
recorded, with the JSON Schema path of what is wrong.
"""

from __future__ import annotations

from typing import Any

from jsonschema import exceptions, validators

from proofline.errors import ArgumentsInvalid, ConfigurationError

#: The most errors one refusal names (the best match first); the rest are counted.
SHOWN_ERRORS = 3


def check_arguments(tool: str, schema: dict[str, Any], arguments: dict[str, Any]) -> None:
    """Raise ``arguments_invalid`` naming each failed path (``$.amount_cents``) when ``arguments``
    do not satisfy ``schema``; ``configuration_error`` when the pinned schema is no JSON Schema."""
    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except exceptions.SchemaError as exc:
        raise ConfigurationError(f"the pinned input schema of tool {tool!r} is not a valid JSON Schema "
                                 f"({exc.message[:200]}): pin the server again and review it", tool=tool) from None
    found = sorted(cls(schema).iter_errors(arguments), key=exceptions.relevance, reverse=True)
    if not found:
        return
    named = "; ".join(f"{e.json_path}: {e.message[:200]}" for e in found[:SHOWN_ERRORS])
    more = f" (and {len(found) - SHOWN_ERRORS} more)" if len(found) > SHOWN_ERRORS else ""
    raise ArgumentsInvalid(f"the arguments do not match the input schema of tool {tool!r}: {named}{more}",
                           tool=tool, path=found[0].json_path)
