"""deltarl's configuration: one file, one ``[daemons.NAME]`` table per daemon.

    files.py    which file (``--config``, ``$DELTARL_CONFIG``, /etc/deltarl/deltarl.toml),
                reading it (TOML or JSON), and the one writer of configuration files
    tables.py   a table to its config class: keys, types, nested tables (links, relays)
    base.py     what every daemon's table has (``drain_timeout_s``, endpoints checked)
    refit.py    the synthetic trainer, export, apply and relay tables
    rl.py       the rollout, trainer and scheduler tables
    checks.py   the checks every class's ``__post_init__`` uses
    errors.py   ConfigError, and EX_CONFIG (78), the exit status systemd does not restart on

The daemons, ``deltarl ctl`` and ``deltarl up`` read configuration through this package
only; nothing here imports a daemon.
"""

from deltarl.config.errors import EX_CONFIG, ConfigError
from deltarl.config.files import CONFIG_ENV, config_path, load_config, toml_text, write_toml
from deltarl.config.tables import build, load

__all__ = [
    "CONFIG_ENV",
    "EX_CONFIG",
    "ConfigError",
    "build",
    "config_path",
    "load",
    "load_config",
    "toml_text",
    "write_toml",
]
