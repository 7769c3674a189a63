"""Multi-turn, tool-using rollouts: each sample a conversation between the model and an environment.

Two ways to write an environment, both loaded with ``--agent_func_path``:

* hybrid's own (:mod:`.environment`): a class with ``reset(prompt, label)`` and ``step(action) -> StepResult``;
* OpenRLHF's agent files, unchanged: ``AgentInstance`` / ``AgentExecutor`` from ``openrlhf.utils.agent`` (a
  stand-in is provided where OpenRLHF is not installed: :mod:`.openrlhf_standin`).

The model's turns are trained (with the engine's log-probs); the environment's replies sit between them in the
same sequence, attended to but masked out of the loss, the KL and the mismatch correction. The built-in
``--task lookup`` (:mod:`.lookup`) is a task that needs a tool call. :mod:`.rollout` runs a step's conversations.
"""

from ..rollout_settings import AgentSettings
from ..tasks import LookupTask
from .environment import Environment, StepResult
from .guard import AgentError
from .loader import AgentSpec, builtin_agent, load_agent
from .lookup import LookupEnvironment
from .rollout import AgentBatch, AgentRollout, summarize

__all__ = [
    "AgentBatch",
    "AgentError",
    "AgentRollout",
    "AgentSettings",
    "AgentSpec",
    "Environment",
    "LookupEnvironment",
    "LookupTask",
    "StepResult",
    "builtin_agent",
    "load_agent",
    "summarize",
]
