"""Import-time stand-in (not the real package): Transformer Engine's ONNX export helpers build schema objects at
import; nothing here works for export. Every attribute, call, index and decoration returns another stand-in."""
import sys
import types

TE_HARNESS_STUB = True


class _Anything:
    def __init__(self, name="stub"):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs and not isinstance(args[0], _Anything):
            return args[0]  # used as a decorator
        return _Anything(f"{self._name}()")

    def __getitem__(self, item):
        return _Anything(f"{self._name}[]")

    def __repr__(self):
        return f"<stand-in {self._name}>"


def __getattr__(item):
    if item.startswith("__"):
        raise AttributeError(item)
    return _Anything(f"{__name__}.{item}")


class _SubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self.__name__}.{item}")


for _sub in ("defs", "values", "onnx_types", "opset18", "helper", "ir"):
    _m = _SubModule(f"{__name__}.{_sub}")
    _m.TE_HARNESS_STUB = True
    sys.modules[_m.__name__] = _m
    globals()[_sub] = _m
