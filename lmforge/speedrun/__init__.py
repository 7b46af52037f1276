"""The speedrun: the whole pipeline in one command, with a report card (nanochat's speedrun.sh).

    lmforge speedrun --preset cpu-tiny          # docs/speedrun.md has its timings

tokenizer -> pretrain -> SFT -> reward model -> DPO -> GRPO (-> PPO) -> eval -> RAG -> report.
`presets` holds the plans, `stages` one class per stage, `runner` the resumable loop,
`evaluate` the common yardstick and `report` the report card.
"""

from lmforge.speedrun.presets import SPEEDRUN_PRESETS, STAGE_ORDER, resolve_plan
from lmforge.speedrun.runner import Speedrun

__all__ = ["SPEEDRUN_PRESETS", "STAGE_ORDER", "Speedrun", "resolve_plan"]
