# R on remote memory with the unmodified `ff` package (paper 003 §8.6).
#
#   Rscript ffdemo.R generate DIR ROWS COLS SEED
#       writes a data set of COLS columns x ROWS rows of doubles as an ffdf,
#       one ff file per column (DIR/c01.ff ...), from the random seed SEED.
#       Column 11 is the response of the regression: 1*c12 + 2*c13 + ... +
#       9*c20 + N(0,1) noise; the other columns are N(0,1).
#
#   Rscript ffdemo.R measure REGIONS_DIR TMPFS_DIR ROWS COLS ROUNDS
#       opens both copies (same seed) read-only as ffdfs and runs, in each
#       round, R-Agg (mean over columns 1-10) and R-LR (lm of c11 on c12..c20)
#       on tmpfs and on regions, alternating. Prints the times and their
#       ratios, and fails unless every result equals the tmpfs one within
#       floating-point tolerance and the fitted coefficients match 1..9.
#
# Sections are 128 KiB wide (options(ffpagesize)), as in the paper.

suppressPackageStartupMessages(library(ff))
options(ffpagesize = 131072)

die <- function(...) {
  message("ffdemo: ", ...)
  quit(status = 1)
}

args <- commandArgs(trailingOnly = TRUE)
if (length(args) < 1) die("usage: generate DIR ROWS COLS SEED | measure REGIONS_DIR TMPFS_DIR ROWS COLS ROUNDS")

col_name <- function(j) sprintf("c%02d", j)
col_file <- function(dir, j) file.path(dir, paste0(col_name(j), ".ff"))
agg_cols <- 1:10
lr_y <- 11
lr_x <- 12:20
beta <- seq_along(lr_x)

generate <- function(dir, n, ncols, seed) {
  if (ncols < max(lr_x)) die("need at least ", max(lr_x), " columns")
  set.seed(seed)
  y <- numeric(n)
  cols <- list()
  for (j in seq_len(ncols)) {
    if (j == lr_y) next
    v <- rnorm(n)
    if (j %in% lr_x) y <- y + beta[j - min(lr_x) + 1] * v
    cols[[col_name(j)]] <- ff(initdata = v, vmode = "double", filename = col_file(dir, j), overwrite = TRUE)
  }
  cols[[col_name(lr_y)]] <- ff(initdata = y + rnorm(n), vmode = "double", filename = col_file(dir, lr_y), overwrite = TRUE)
  cols <- cols[col_name(seq_len(ncols))]
  df <- do.call(ffdf, cols)
  cat(sprintf("generated an ffdf of %d rows x %d columns (%.0f MiB) in %s\n",
              nrow(df), ncol(df), nrow(df) * ncol(df) * 8 / 2^20, dir))
  for (x in cols) close(x)
}

open_ffdf <- function(dir, n, ncols) {
  cols <- lapply(seq_len(ncols), function(j) {
    f <- col_file(dir, j)
    if (!file.exists(f)) die("missing column file ", f)
    x <- ff(vmode = "double", filename = f, readonly = TRUE)
    if (length(x) != n) die(f, " holds ", length(x), " rows, expected ", n)
    x
  })
  names(cols) <- col_name(seq_len(ncols))
  do.call(ffdf, cols)
}

# R-Agg: the mean of each of ten columns, read chunk by chunk.
r_agg <- function(df) {
  vapply(col_name(agg_cols), function(name) {
    x <- df[[name]]
    s <- 0
    for (i in chunk(x)) s <- s + sum(x[i])
    s / length(x)
  }, numeric(1))
}

# R-LR: a linear regression over ten columns.
r_lr <- function(df) {
  d <- df[, col_name(c(lr_y, lr_x))]
  coef(lm(as.formula(paste(col_name(lr_y), "~ .")), data = d))
}

timed <- function(f, df) {
  gc(verbose = FALSE)
  t <- system.time(r <- f(df))[["elapsed"]]
  list(time = t, result = r)
}

measure <- function(rdir, tdir, n, ncols, rounds) {
  regions <- open_ffdf(rdir, n, ncols)
  tmpfs <- open_ffdf(tdir, n, ncols)
  # Warm R itself up (lm, chunk) on a small in-memory frame so that the
  # first timed run does not pay for it.
  invisible(lm(y ~ x, data.frame(x = rnorm(1000), y = rnorm(1000))))
  cat(sprintf("R-Agg: mean over %d columns; R-LR: lm over %d columns; %d rows (%.0f MiB per workload)\n",
              length(agg_cols), 1 + length(lr_x), n, 10 * n * 8 / 2^20))
  cat(sprintf("%-6s %-8s %-5s %10s %10s %7s\n", "round", "workload", "", "tmpfs s", "regions s", "ratio"))
  ok <- TRUE
  worst <- 0
  summary <- list()
  for (round in seq_len(rounds)) {
    state <- if (round == 1) "cold" else "warm"
    for (w in list(list("R-Agg", r_agg), list("R-LR", r_lr))) {
      t <- timed(w[[2]], tmpfs)
      r <- timed(w[[2]], regions)
      diff <- max(abs(r$result - t$result) / pmax(abs(t$result), 1e-300))
      worst <- max(worst, diff)
      if (!isTRUE(all.equal(r$result, t$result, tolerance = 1e-9))) {
        ok <- FALSE
        message("ffdemo: ", w[[1]], " on regions differs from tmpfs: ", paste(format(r$result), collapse = " "),
                " vs ", paste(format(t$result), collapse = " "))
      }
      if (w[[1]] == "R-LR") {
        est <- unname(t$result[-1])
        if (any(abs(est - beta) > 0.05)) {
          ok <- FALSE
          message("ffdemo: R-LR coefficients ", paste(format(est), collapse = " "), " are not 1..9")
        }
      }
      ratio <- r$time / max(t$time, 1e-9)
      summary[[length(summary) + 1]] <- sprintf("%s-%s %.3f %.3f %.3f", w[[1]], state, t$time, r$time, ratio)
      cat(sprintf("%-6d %-8s %-5s %10.3f %10.3f %7.3f\n", round, w[[1]], state, t$time, r$time, ratio))
    }
  }
  cat(sprintf("R-Agg means (regions): %s\n", paste(sprintf("%.5f", r_agg(regions)), collapse = " ")))
  cat(sprintf("R-LR coefficients (regions): %s\n", paste(sprintf("%.4f", r_lr(regions)), collapse = " ")))
  cat(sprintf("results equal to tmpfs: %s (largest relative difference %.3g)\n", if (ok) "yes" else "NO", worst))
  for (s in summary) cat("summary", s, "\n")
  if (!ok) quit(status = 1)
}

mode <- args[[1]]
if (mode == "generate" && length(args) == 5) {
  generate(args[[2]], as.integer(args[[3]]), as.integer(args[[4]]), as.integer(args[[5]]))
} else if (mode == "measure" && length(args) == 6) {
  measure(args[[2]], args[[3]], as.integer(args[[4]]), as.integer(args[[5]]), as.integer(args[[6]]))
} else {
  die("usage: generate DIR ROWS COLS SEED | measure REGIONS_DIR TMPFS_DIR ROWS COLS ROUNDS")
}
