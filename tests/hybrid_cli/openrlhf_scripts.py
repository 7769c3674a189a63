"""OpenRLHF's launch scripts stored as test data (data/openrlhf_scripts): reading them and pointing their models,
data and outputs at local stand-ins."""

import os
import shlex

DATA = os.path.join(os.path.dirname(__file__), "data")
SCRIPTS = os.path.join(DATA, "openrlhf_scripts")
#: Flags (either spelling) whose value is a path or an id, and what the test puts there.
_MODEL_FLAGS = {
    "pretrain": "policy",
    "actor.model_name_or_path": "policy",
    "reward_pretrain": "reward",
    "reward.model_name_or_path": "reward",
    "critic_pretrain": "reward",
    "critic.model_name_or_path": "reward",
}
_OUT_FLAGS = ("save_path", "ckpt.output_dir", "ckpt_path", "ckpt.path", "logger.tensorboard_dir")
_DATA_FLAGS = ("prompt_data", "data.prompt_dataset", "eval_dataset", "eval.dataset")
_REWARD_FLAGS = ("remote_rm_url", "reward.remote_url")
_AGENT_FLAGS = ("agent_func_path", "train.agent_func_path")

#: An OpenRLHF-shaped reward file: reward_func(queries, prompts, labels) -> scores (here: completion length).
OPENRLHF_REWARD_FILE = (
    "import torch\n\n"
    "def reward_func(queries, prompts, labels):\n"
    "    return torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])\n"
)

#: An OpenRLHF-shaped agent file (--agent_func_path), written as OpenRLHF's examples write theirs.
OPENRLHF_AGENT_FILE = (
    "import torch\n"
    "from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n\n\n"
    "class AgentInstance(AgentInstanceBase):\n"
    "    def __init__(self, *args, **kwargs):\n"
    "        self.turn = 0\n\n"
    "    async def reset(self, states, **kwargs):\n"
    "        return {'observation': states['observation']}\n\n"
    "    async def step(self, states, **kwargs):\n"
    "        self.turn += 1\n"
    "        reward = torch.tensor(float(states['label'] in states['action_text']))\n"
    "        return {'rewards': reward, 'scores': reward, 'environment_feedback': ' s0', 'done': self.turn >= 2,\n"
    "                'sampling_params': states.get('sampling_params'), 'extra_logs': {'turn': self.turn}}\n\n\n"
    "class AgentExecutor(MultiTurnAgentExecutor):\n"
    "    def __init__(self):\n"
    "        super().__init__(AgentInstance)\n"
)


def read_args(path):
    with open(path) as f:
        text = " ".join(line.strip() for line in f if line.strip() and not line.startswith("#"))
    return shlex.split(text.replace("{wandb_token}", "not-a-real-key"))


def openrlhf_script_argv(name, *, policy, reward, prompts, out_dir):
    argv = read_args(os.path.join(SCRIPTS, name))
    out = []
    for i, word in enumerate(argv):
        flag = argv[i - 1][2:] if i and argv[i - 1].startswith("--") else None
        if flag in _MODEL_FLAGS:
            word = policy if _MODEL_FLAGS[flag] == "policy" else reward
        elif flag in _OUT_FLAGS:
            word = str(out_dir / flag.replace(".", "_"))
        elif flag in _DATA_FLAGS:
            word = ",".join(prompts["data"][: len(word.split(","))])
        elif flag in _REWARD_FLAGS and not word.startswith("http"):
            word = prompts["reward"]
        elif flag in _AGENT_FLAGS:
            word = prompts["agent"]
        out.append(word)
    return out
