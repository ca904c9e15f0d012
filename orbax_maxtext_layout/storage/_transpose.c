/* The transposing copy of 2-byte items import-hf makes of every Hugging Face kernel
 * (called through storage/transpose.py): 8 x 8 blocks transposed in SSE2 registers, with the
 * GIL released so that the import's workers transpose side by side. NumPy's strided copy of
 * the same view moves 0.25 GiB/s here, import-hf's word-packing NumPy copy
 * (hf/import_hf.py, _transpose: the fallback) 1.8 to 2.0, this 4.1. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>

/* s[i * ls + j] -> d[j * ld + i] for i, j < 8 */
static inline void block8(const uint16_t *s, Py_ssize_t ls, uint16_t *d, Py_ssize_t ld) {
  __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * ls));
  __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * ls));
  __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * ls));
  __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * ls));
  __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * ls));
  __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * ls));
  __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * ls));
  __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * ls));
  __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
  __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
  __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
  __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
  __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
  __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
  _mm_storeu_si128((__m128i *)(d + 0 * ld), _mm_unpacklo_epi64(c0, c4));
  _mm_storeu_si128((__m128i *)(d + 1 * ld), _mm_unpackhi_epi64(c0, c4));
  _mm_storeu_si128((__m128i *)(d + 2 * ld), _mm_unpacklo_epi64(c1, c5));
  _mm_storeu_si128((__m128i *)(d + 3 * ld), _mm_unpackhi_epi64(c1, c5));
  _mm_storeu_si128((__m128i *)(d + 4 * ld), _mm_unpacklo_epi64(c2, c6));
  _mm_storeu_si128((__m128i *)(d + 5 * ld), _mm_unpackhi_epi64(c2, c6));
  _mm_storeu_si128((__m128i *)(d + 6 * ld), _mm_unpacklo_epi64(c3, c7));
  _mm_storeu_si128((__m128i *)(d + 7 * ld), _mm_unpackhi_epi64(c3, c7));
}
#else
static inline void block8(const uint16_t *s, Py_ssize_t ls, uint16_t *d, Py_ssize_t ld) {
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++) d[j * ld + i] = s[i * ls + j];
}
#endif

/* Source rows a pass: 128 of them, 8 at a time, for every 8 rows of the output. Each output
 * row then gets 256 contiguous bytes a pass (fastest of 16 to 256 here, 8B llama kernels). */
#define GROUP 128

/* d[r * cols + c] = s[c * ld + r] for r < rows, c < cols */
static void transpose2(uint16_t *d, const uint16_t *s, Py_ssize_t rows, Py_ssize_t cols,
                       Py_ssize_t ld) {
  Py_ssize_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (Py_ssize_t c0 = 0; c0 < cols8; c0 += GROUP) {
    Py_ssize_t c1 = c0 + GROUP < cols8 ? c0 + GROUP : cols8;
    for (Py_ssize_t r = 0; r < rows8; r += 8)
      for (Py_ssize_t c = c0; c < c1; c += 8) block8(s + c * ld + r, ld, d + r * cols + c, cols);
  }
  for (Py_ssize_t r = 0; r < rows; r++) /* what the blocks leave: the last columns and rows */
    for (Py_ssize_t c = (r < rows8 ? cols8 : 0); c < cols; c++) d[r * cols + c] = s[c * ld + r];
}

static PyObject *transpose(PyObject *Py_UNUSED(module), PyObject *args) {
  PyObject *out_obj, *src_obj;
  if (!PyArg_ParseTuple(args, "OO", &out_obj, &src_obj)) return NULL;
  Py_buffer out, src;
  if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
  if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES) < 0) {
    PyBuffer_Release(&out);
    return NULL;
  }
  PyObject *result = NULL;
  if (out.ndim != 2 || src.ndim != 2 || out.itemsize != 2 || src.itemsize != 2 ||
      out.shape[0] != src.shape[0] || out.shape[1] != src.shape[1]) {
    PyErr_SetString(PyExc_ValueError,
                    "transpose(out, src): two 2-D arrays of one shape and 2-byte items");
  } else if ((src.shape[0] > 1 && src.strides[0] != 2) ||
             (src.shape[1] > 1 && (src.strides[1] < 2 * src.shape[0] || src.strides[1] % 2))) {
    /* a transposed view: its first axis steps one item, its second whole columns */
    PyErr_SetString(PyExc_ValueError,
                    "transpose(out, src): src must be a transposed view (rows of src.T contiguous)");
  } else {
    Py_ssize_t rows = out.shape[0], cols = out.shape[1], ld = src.strides[1] / 2;
    if (rows > 0 && cols > 0) {
      Py_BEGIN_ALLOW_THREADS
      transpose2((uint16_t *)out.buf, (const uint16_t *)src.buf, rows, cols, ld);
      Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
  }
  PyBuffer_Release(&src);
  PyBuffer_Release(&out);
  return result;
}

static PyMethodDef methods[] = {
    {"transpose", transpose, METH_VARARGS,
     "transpose(out, src): out[...] = src for a C-contiguous 2-D out and a transposed 2-D view "
     "src of 2-byte items, without the GIL."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_transpose", "import-hf's transposing copy of 2-byte items.", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__transpose(void) { return PyModule_Create(&module); }
