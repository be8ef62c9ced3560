// An empty Python module, so `import flashattn_ext._C` loads the library and its
// static initializers register the ops. Built against the limited Python API.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
