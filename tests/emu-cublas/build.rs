fn main() {
    // cudarc opens "libcublas.so" first: loaded by path under that soname, this is the one
    // it finds (DFLASH_CUBLAS_LIB).
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcublas.so");
}
