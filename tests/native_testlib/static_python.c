/* A python executable with libpython linked in statically (no libpython*.so),
 * built by the tests from the interpreter's own libpython*.a, so that the
 * module registry must find the eval loop in the main program. */
#include <Python.h>

int main(int argc, char** argv) { return Py_BytesMain(argc, argv); }
