"""The config options of the commands that take a run's config: ``--preset``,
``--config FILE.toml`` and ``--set KEY=VALUE`` (applied in that order)."""

from __future__ import annotations

import argparse

from freescale.config import PRESETS, TrainConfig, build_config


def add_config_args(p: argparse.ArgumentParser, what: str = "override a config key") -> None:
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="a config file (what --print-config prints), on the preset; --set goes on top",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{what} section.key (repeatable), e.g. --set run.mode=sdd",
    )


def add_code_args(p: argparse.ArgumentParser, data_moves: bool = False) -> None:
    """``--model`` / ``--data``: code a checkpoint names, confirmed by the caller
    (`freescale.serving.checkpoint.confirm_code`); ``--data KIND:PATH`` of a
    built-in kind also says where the run's data file is now."""
    p.add_argument("--model", help="the run's model factory package.module:name, when not "
                   "FreeScale's own (imported: name only code you trust)")  # fmt: skip
    where = "where the run's data is now (e.g. sasrec:/data/my.txt: the same schema, any path"
    where += ")" if data_moves else "; without it the checkpoint's own record is used)"
    p.add_argument(
        "--data",
        help="the run's data factory package.module:name, when not a "
        f"built-in source (imported: name only code you trust); or {where}",
    )


def config_from_args(args: argparse.Namespace, overrides: list[str]) -> TrainConfig:
    """The config of ``--preset``, ``--config`` and ``overrides``, its empty
    paths under ``output.dir`` (`freescale.run.run_dir`); ValueError: one line."""
    from freescale.run.run_dir import in_run_dir

    if args.config is None:
        cfg = build_config(args.preset, overrides)
    else:
        from freescale.config.files import load_config

        cfg = load_config(args.config, args.preset, overrides)
    return in_run_dir(cfg)
