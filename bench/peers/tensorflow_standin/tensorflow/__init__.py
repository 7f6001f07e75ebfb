"""A minimal stand-in for the parts of TensorFlow 1.x that google-research/bert's
`create_pretraining_data.py` and `tokenization.py` use, so that the unmodified script can be
timed beside bertkit without installing TensorFlow.

Provided: `flags` (DEFINE_*, FLAGS, mark_flag_as_required), `logging`, `gfile` (GFile reads
lines split at "\\n" only, as TensorFlow does; Glob), `app.run`, `train.Example` & co, and
`python_io.TFRecordWriter`, which writes each example's features as one JSON line instead of a
binary TFRecord (the reference outputs in shared/data/reference were made the same way).
"""
import glob as _glob
import json as _json
import logging as _pylogging
import sys as _sys


class _Flags:
    def __init__(self):
        object.__setattr__(self, "_convert", {})

    def _define(self, name, default, convert):
        self._convert[name] = convert
        object.__setattr__(self, name, default)

    def _parse(self, argv):
        for arg in argv[1:]:
            if not arg.startswith("--"):
                continue
            name, _, value = arg[2:].partition("=")
            if name not in self._convert:
                raise SystemExit(f"unknown flag --{name}")
            object.__setattr__(self, name, self._convert[name](value))


def _to_bool(value):
    return value.lower() in ("1", "true", "yes", "")


class flags:  # noqa: N801 (mirrors tf.flags)
    FLAGS = _Flags()

    @staticmethod
    def DEFINE_string(name, default, help=None):  # noqa: N802
        flags.FLAGS._define(name, default, str)

    @staticmethod
    def DEFINE_bool(name, default, help=None):  # noqa: N802
        flags.FLAGS._define(name, default, _to_bool)

    DEFINE_boolean = DEFINE_bool

    @staticmethod
    def DEFINE_integer(name, default, help=None):  # noqa: N802
        flags.FLAGS._define(name, default, int)

    @staticmethod
    def DEFINE_float(name, default, help=None):  # noqa: N802
        flags.FLAGS._define(name, default, float)

    @staticmethod
    def mark_flag_as_required(name):
        pass


class logging:  # noqa: N801
    INFO = _pylogging.INFO

    @staticmethod
    def set_verbosity(level):
        _pylogging.basicConfig(level=_pylogging.WARNING)

    @staticmethod
    def info(msg, *args):
        _pylogging.info(msg, *args)


class gfile:  # noqa: N801
    @staticmethod
    def GFile(path, mode="r"):  # noqa: N802
        if "b" in mode:
            return open(path, mode)
        return open(path, mode, encoding="utf-8", newline="\n")

    @staticmethod
    def Glob(pattern):  # noqa: N802
        return sorted(_glob.glob(pattern))


class app:  # noqa: N801
    @staticmethod
    def run():
        flags.FLAGS._parse(_sys.argv)
        _sys.modules["__main__"].main(_sys.argv)


class _List:
    def __init__(self, value=()):
        self.value = list(value)


class train:  # noqa: N801
    Int64List = _List
    FloatList = _List

    class Feature:
        def __init__(self, int64_list=None, float_list=None):
            self.int64_list = int64_list or _List()
            self.float_list = float_list or _List()
            self.values = (int64_list or float_list).value

    class Features:
        def __init__(self, feature):
            self.feature = feature

    class Example:
        def __init__(self, features):
            self.features = features

        def SerializeToString(self):  # noqa: N802
            return _json.dumps({k: v.values for k, v in self.features.feature.items()}).encode()


class python_io:  # noqa: N801
    class TFRecordWriter:
        def __init__(self, path):
            self._f = open(path, "wb")

        def write(self, record):
            self._f.write(record + b"\n")

        def close(self):
            self._f.close()
