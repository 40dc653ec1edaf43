"""A host double of tools/fatbin_driver.Driver for the A/B tools' CPU tests: numpy buffers with the
Driver's methods, and launches that a subclass emulates from the kernel's contract."""
import numpy as np


class HostTensor:
    def __init__(self, a: np.ndarray):
        self.a = a

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    @property
    def shape(self):
        return self.a.shape


class HostDriver:
    """The Driver's methods over numpy; launch() is the subclass's emulation of the kernel."""

    torch = None

    def __init__(self):
        self.tensors, self.launches = [], []
        self.rng = np.random.default_rng(5)

    def _keep(self, a):
        t = HostTensor(a)
        self.tensors.append(t)
        return t

    def upload(self, a):
        return self._keep(np.array(a, copy=True))

    def full(self, shape, value):
        return self._keep(np.full(shape, value, np.float32))

    def randn(self, shape):
        return self._keep(self.rng.standard_normal(shape).astype(np.float32))

    def download(self, t):
        return t.a.copy()

    def num_sms(self):
        return 4                                 # few: a persistent launch's blocks each take several items

    def time_ms(self, fn, repeats, warmup=3):
        fn()
        return [1.0] * repeats

    def module(self, path):
        return path

    def function(self, mod, name):
        return mod, name

    def _bytes_at(self, addr: int, n: int) -> np.ndarray:
        for t in self.tensors:
            base = t.data_ptr()
            if base <= addr < base + t.a.nbytes:
                return t.a.reshape(-1).view(np.uint8)[addr - base:addr - base + n]
        raise AssertionError(f"no buffer holds address {addr:#x}")

    def _tensor(self, addr: int) -> np.ndarray:
        return next(t.a for t in self.tensors if t.data_ptr() == addr)
