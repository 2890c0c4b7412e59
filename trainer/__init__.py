"""The bundled trainer: a parameter-server KVStore over ZeroMQ and MNIST training with PyTorch."""
