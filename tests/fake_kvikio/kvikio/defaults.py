"""kvikio.defaults: the settings getter and setter."""

_settings = {"compat_mode": "ON", "num_threads": 4, "task_size": 4 << 20}


def get(name):
    return _settings[name]


def set(name, value=None):
    _settings[name] = value
